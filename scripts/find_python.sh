#!/usr/bin/env sh
# Print the path of a Python >= 3.12 interpreter: $PYTHON if set, else the first suitable one on
# PATH, else the newest suitable pyenv-managed version. Exits 1 with a message if there is none.
is_suitable() {
  "$@" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1
}
for candidate in ${PYTHON:-} python3.13 python3.12 python3 python; do
  if is_suitable "$candidate"; then
    "$candidate" -c 'import sys; print(sys.executable)'
    exit 0
  fi
done
if command -v pyenv >/dev/null 2>&1; then
  for version in $(pyenv versions --bare 2>/dev/null | sort -t. -k1,1n -k2,2n -k3,3n -r); do
    if PYENV_VERSION="$version" is_suitable python3; then
      PYENV_VERSION="$version" python3 -c 'import sys; print(sys.executable)'
      exit 0
    fi
  done
fi
echo "error: no Python >= 3.12 found (set PYTHON=/path/to/python3.12)" >&2
exit 1
