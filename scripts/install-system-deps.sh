#!/usr/bin/env bash
# Installs the system programs the test suite talks to, when they are missing and we may:
#   redis-server                (the Redis KV tier's tests start their own servers)
#   chromium + chromium-driver  (the dashboard's headless browser test)
#   gcc                         (the native CPU kernels, compiled at first use)
# Runs apt-get only as root and only for what is missing, so a second run costs nothing and a
# non-root user gets one line per missing program instead of a failure (those tests then skip
# with the reason). `make setup` and .ci/run both call this script.
set -uo pipefail

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
{ command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; } \
  || missing+=(chromium chromium-driver)
command -v cc >/dev/null 2>&1 || missing+=(gcc libgomp1)

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "note: missing ${missing[*]} (install them with apt-get as root); the tests that need them will skip" >&2
  exit 0
fi
echo "installing system packages: ${missing[*]}" >&2
if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null; }; then
  echo "warning: apt-get could not install ${missing[*]}; the tests that need them will skip" >&2
fi
exit 0
