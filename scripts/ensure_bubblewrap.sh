#!/usr/bin/env bash
# Make sure bubblewrap (bwrap) is on PATH and can start a sandbox, for the code_execution reward's
# strongest isolation and its hostile-answer tests (tests/test_sandbox_hostile.py). If it is missing
# and this process may install it (root, apt-get), install Debian's bubblewrap package. Never an
# error: exit 0 when a working bwrap is there, exit 1 after one line saying why the bubblewrap tests
# will be skipped. GRPOKIT_NO_SANDBOX_INSTALL=1 turns the install off.
set -uo pipefail

skip() { echo "note: the bubblewrap sandbox tests will be skipped: $*"; exit 1; }

# The namespaces code_execution asks for: as root bwrap needs no user namespace, otherwise it does.
works() {
  local userns=()
  [ "$(id -u)" -eq 0 ] || userns=(--unshare-user)
  bwrap "${userns[@]}" --unshare-pid --unshare-net --ro-bind / / --proc /proc --dev /dev true 2>&1
}

if ! command -v bwrap >/dev/null; then
  [ "${GRPOKIT_NO_SANDBOX_INSTALL:-}" = 1 ] && skip "no bwrap on PATH and GRPOKIT_NO_SANDBOX_INSTALL=1"
  [ "$(id -u)" -eq 0 ] || skip "no bwrap on PATH and not root to install it (apt-get install bubblewrap)"
  command -v apt-get >/dev/null || skip "no bwrap on PATH and no apt-get to install it"
  echo "installing bubblewrap (apt-get) for the code_execution sandbox tests ..."
  log="$(mktemp)"
  trap 'rm -f "$log"' EXIT
  export DEBIAN_FRONTEND=noninteractive
  if ! { apt-get update -qq && apt-get install -y -qq -o DPkg::Lock::Timeout=120 bubblewrap; } >"$log" 2>&1; then
    skip "apt-get install bubblewrap failed: $(grep -E '^(E|W|Err):' "$log" | tail -n 1 || tail -n 1 "$log")"
  fi
  command -v bwrap >/dev/null || skip "apt-get installed bubblewrap but no bwrap is on PATH"
fi
out="$(works)" || skip "bwrap cannot create namespaces here: $(printf '%s' "$out" | tail -n 1)"
exit 0
