#!/usr/bin/env bash
# Make sure a Chromium/Chrome binary is on PATH for the HTML-report browser test
# (tests/test_report.py). If none is found and this process may install one (root, apt-get),
# install Debian's chromium package. Never an error: exit 0 when a browser is there,
# exit 1 after one line saying why the browser test will be skipped.
# GRPOKIT_NO_BROWSER_INSTALL=1 turns the install off.
set -uo pipefail

find_browser() {
  local name
  for name in chromium chromium-browser google-chrome google-chrome-stable chrome; do
    command -v "$name" && return 0
  done
  return 1
}

skip() { echo "note: the HTML-report browser test will be skipped: $*"; exit 1; }

find_browser >/dev/null && exit 0
[ "${GRPOKIT_NO_BROWSER_INSTALL:-}" = 1 ] && skip "no chromium on PATH and GRPOKIT_NO_BROWSER_INSTALL=1"
[ "$(id -u)" -eq 0 ] || skip "no chromium on PATH and not root to install it (apt-get install chromium)"
command -v apt-get >/dev/null || skip "no chromium on PATH and no apt-get to install it"

echo "installing chromium (apt-get) for the HTML-report browser test ..."
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -qq && apt-get install -y -qq -o DPkg::Lock::Timeout=120 chromium; } >"$log" 2>&1; then
  skip "apt-get install chromium failed: $(grep -E '^(E|W|Err):' "$log" | tail -n 1 || tail -n 1 "$log")"
fi
find_browser >/dev/null || skip "apt-get installed chromium but no chromium binary is on PATH"
exit 0
