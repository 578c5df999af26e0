#!/usr/bin/env bash
# Installs Debian's chromium-headless-shell, and the libraries it needs that this system lacks,
# into one folder (default .venv/chromium) without root: `apt-get download` + `dpkg -x`, so the
# system is left as it is. tools/docs/browser_check.py runs DIR/usr/lib/chromium/chromium-headless-shell
# with LD_LIBRARY_PATH set to the folder's libraries. Called by launch/test.sh when DIR lacks it.
#   bash tools/docs/install_chromium.sh [DIR]
set -euo pipefail
DIR="$(mkdir -p "${1:-.venv/chromium}" && cd "${1:-.venv/chromium}" && pwd)"
command -v apt-get >/dev/null || { echo "install_chromium.sh: needs apt-get (Debian/Ubuntu); or set RLT_CHROMIUM to a Chromium binary" >&2; exit 1; }
DEBS="$DIR/debs"; mkdir -p "$DEBS"
declare -A seen=()
todo=(chromium-headless-shell)
while [ ${#todo[@]} -gt 0 ]; do
  pkg="${todo[0]}"; todo=("${todo[@]:1}")
  [ -n "${seen[$pkg]:-}" ] && continue; seen[$pkg]=1
  # a dependency the system already has is used from the system
  if [ "$pkg" != chromium-headless-shell ] && dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    continue
  fi
  (cd "$DEBS" && apt-get download -q "$pkg" >/dev/null 2>&1) || { echo "install_chromium.sh: apt-get download $pkg failed" >&2; exit 1; }
  for dep in $(apt-cache depends --no-recommends --no-suggests --no-conflicts --no-breaks --no-replaces --no-enhances "$pkg" \
               | awk '/^ *(Pre)?Depends:/ {print $2}' | grep -v '^<'); do
    todo+=("$dep")
  done
done
for deb in "$DEBS"/*.deb; do dpkg -x "$deb" "$DIR"; done
rm -rf "$DEBS"
BIN="$DIR/usr/lib/chromium/chromium-headless-shell"
LIBS="$(find "$DIR" -name '*.so*' -printf '%h\n' | sort -u | paste -sd:)"
missing="$(LD_LIBRARY_PATH="$LIBS" ldd "$BIN" | grep 'not found' || true)"
[ -z "$missing" ] || { echo "install_chromium.sh: still missing after the install:" >&2; echo "$missing" >&2; exit 1; }
echo "$LIBS" > "$DIR/ld_library_path"
echo "chromium-headless-shell installed in $DIR"
