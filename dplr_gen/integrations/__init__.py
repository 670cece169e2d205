"""Integrations: other libraries' models routed to dplr-gen's ops (``dplr_gen.integrations.fla``). Nothing here
imports those libraries until a switch is turned on."""
