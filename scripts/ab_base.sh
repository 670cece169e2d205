#!/usr/bin/env bash
# Here, before a GPU A/B call: the sources of git revision REF (default HEAD), or with --worktree those of the
# working tree as they stand (a snapshot before an edit; no git needed), unpacked into DIR (default .exp/ab/base):
# the base tree that scripts/ab_gpu.sh builds and times against the working tree. A DIR under .exp/ is kept out
# of git through .git/info/exclude, so the device call must name .exp in `carry` (with .whl).
#   scripts/ab_base.sh [REF | --worktree] [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
REF=${1:-HEAD}; DIR=${2:-.exp/ab/base}
PATHS=(dplr_gen templates scripts specs pyproject.toml
       benchmarks/__init__.py benchmarks/common.py benchmarks/bench.py benchmarks/tune.py)
if [ "$REF" != --worktree ] && ! git rev-parse --verify -q "$REF^{commit}" >/dev/null; then
  echo "ab_base.sh: $REF is not a git revision (or give --worktree)" >&2; exit 2
fi
rm -rf "$DIR" && mkdir -p "$DIR"
if [ "$REF" = --worktree ]; then
  tar -c --exclude=__pycache__ "${PATHS[@]}" | tar -x -C "$DIR"
  echo "worktree $(git rev-parse --short HEAD 2>/dev/null || echo '(no git)') $(date -u +%FT%TZ)" > "$DIR/.ab_ref"
else
  git archive "$REF" "${PATHS[@]}" | tar -x -C "$DIR"
  git rev-parse "$REF" > "$DIR/.ab_ref"
fi
case "$(realpath -m "$DIR")" in
  "$PWD"/.exp/*) grep -qxF '/.exp/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info && echo '/.exp/' >> .git/info/exclude; } ;;
esac
echo "$DIR: $(cat "$DIR/.ab_ref") ($(du -sh "$DIR" | cut -f1)); carry .exp and .whl in the device call"
