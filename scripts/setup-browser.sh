#!/usr/bin/env bash
# Install Debian's Chromium and chromedriver (if missing) for the dashboard's browser test
# (tests/test_dashboard.py drives them through Selenium; nothing is downloaded by Selenium).
# Needs apt-get and root or password-less sudo. .ci/run calls it; locally, without them, the
# browser test is skipped.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup-browser.sh: no apt-get here; install Chromium and chromedriver yourself" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO="sudo -n"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >/dev/null
$SUDO apt-get install -y -qq chromium chromium-driver >/dev/null
