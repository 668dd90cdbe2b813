#!/bin/sh
# System packages marlaas needs beyond pip, installed where missing and possible (root + apt-get):
#   bubblewrap (`bwrap`): the python tool's sandbox. Without it env does not serve `python` unless
#     the operator sets env.python_isolation = "none".
#   chromium and chromium-driver: the dashboard's browser tests (tests/ui/).
set -eu
need=""
for pair in bwrap:bubblewrap chromium:chromium chromedriver:chromium-driver; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || need="$need ${pair#*:}"
done
[ -z "$need" ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install-system: missing:$need, which cannot be installed here (needs root and apt-get):" \
         "without bubblewrap env does not serve the python tool; without chromium tests/ui/ fail" >&2
    exit 0
fi
# shellcheck disable=SC2086
"$(dirname "$0")/apt-install.sh" $need
echo "install-system: installed$need"
