#!/bin/sh
# Print the path of a Python >= 3.12 on this machine, or explain why there is none (exit 1).
# Order: $PYTHON if set, python3.13/python3.12/python3 on PATH, then pyenv / common install prefixes.
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; }
for cand in "${PYTHON:-}" python3.14 python3.13 python3.12 python3; do
  [ -n "$cand" ] || continue
  p=$(command -v "$cand" 2>/dev/null) || continue
  # pyenv shims exist for versions that are not selected; ask the shim to run it before trusting it
  if ok "$p"; then echo "$p"; exit 0; fi
done
for root in "${PYENV_ROOT:-$HOME/.pyenv}/versions" /usr/local/bin /opt/python /usr/bin; do
  for p in "$root"/3.1[2-9]*/bin/python3 "$root"/python3.1[2-9]; do
    [ -x "$p" ] && ok "$p" && { echo "$p"; exit 0; }
  done
done
echo "error: no Python >= 3.12 found (tried \$PYTHON, python3.1x/python3 on PATH, pyenv versions)." >&2
echo "Install one (e.g. 'pyenv install 3.12') or run: make PYTHON=/path/to/python3.12 setup" >&2
exit 1
