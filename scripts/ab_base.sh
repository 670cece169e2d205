#!/usr/bin/env bash
# Here, before a GPU A/B call: the sources of git revision REF (default HEAD) unpacked into DIR (default
# .exp/ab/base), the base tree that scripts/ab_gpu.sh builds and times against the working tree. .exp/ is
# ignored through .git/info/exclude, so the device call must name it in `carry` (with .whl).
#   scripts/ab_base.sh [REF] [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
REF=${1:-HEAD}; DIR=${2:-.exp/ab/base}
git rev-parse --verify -q "$REF^{commit}" >/dev/null || { echo "ab_base.sh: $REF is not a git revision" >&2; exit 2; }
rm -rf "$DIR" && mkdir -p "$DIR"
git archive "$REF" dplr_gen templates scripts specs pyproject.toml \
  benchmarks/__init__.py benchmarks/common.py benchmarks/bench.py benchmarks/tune.py | tar -x -C "$DIR"
git rev-parse "$REF" > "$DIR/.ab_ref"
case "$(realpath -m "$DIR")" in  # a base tree under .exp/ of this checkout: keep git (and commits) off it
  "$PWD"/.exp/*) grep -qxF '/.exp/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info && echo '/.exp/' >> .git/info/exclude; } ;;
esac
echo "$DIR: $(git rev-parse --short "$REF") ($(du -sh "$DIR" | cut -f1)); carry .exp and .whl in the device call"
