#!/usr/bin/env bash
# Screenshots of a board `harness report` wrote, in headless Chromium (the
# page loads nothing from the network): the board's first screen and the
# first submission's own page, to look at after changing the page.
#
#   scripts/board-screenshots.sh BOARD_DIR [OUT_DIR] [WIDTH] [HEIGHT]
#
# writes OUT_DIR/board.png and OUT_DIR/submission.png (OUT_DIR defaults to
# BOARD_DIR). Boards of the committed bundles, without building harness:
#
#   BOARD_OUT=/tmp/boards cargo test --release -p harness-report committed_bundles
#
# writes /tmp/boards/h100, /tmp/boards/h200 and /tmp/boards/h100-1.2 (the
# compression tracks of docs/leaderboard.png, taken at 1400 x 1700).
set -euo pipefail
board=${1:?usage: scripts/board-screenshots.sh BOARD_DIR [OUT_DIR] [WIDTH] [HEIGHT]}
out=${2:-$board}
width=${3:-1400}
height=${4:-1800}
chromium=$(command -v chromium || command -v chromium-browser || true)
[ -n "$chromium" ] || { echo "chromium is not installed (sudo apt-get install -y chromium)" >&2; exit 2; }
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
shot() {
  "$chromium" --headless --no-sandbox --disable-gpu --hide-scrollbars --no-first-run --disable-background-networking \
    --disable-component-update --disable-sync --user-data-dir="$profile" --window-size="$width,$height" \
    --screenshot="$2" "file://$(realpath "$1")" 2>/dev/null
}
mkdir -p "$out"
shot "$board/index.html" "$out/board.png"
page=$(ls "$board"/bundles/*/index.html 2>/dev/null | head -1 || true)
[ -z "$page" ] || shot "$page" "$out/submission.png"
ls -l "$out"/board.png ${page:+"$out/submission.png"}
