#!/usr/bin/env bash
# The build cache of ./x test, outside the clone:
#   scripts/build-cache.sh restore   copies the cache to target/ (if there is one)
#   scripts/build-cache.sh save      makes target/ the cache
# The cache is one copy of a target/ folder (about 4.5 GB after ./x test),
# at ${HARNESS_CACHE:-~/.cache/harness}/target, replaced as a whole on each
# save, so it never grows beyond one build. Copies keep modification times
# (cargo compares the dependencies' with their sources'; the workspace's
# crates are always rebuilt) and are taken under a lock, so
# two clones on one machine do not mix halves of two builds. The docs and
# scratch folders are left out.
set -euo pipefail
cd "$(dirname "$0")/.."
cache=${HARNESS_CACHE:-$HOME/.cache/harness}
mkdir -p "$cache"
exec 9> "$cache/target.lock"
flock 9
case "${1:-}" in
  restore)
    if [ -d "$cache/target" ]; then
      cp -a --reflink=auto "$cache/target" target
      # The workspace's own crates (harness*, plugins and fixtures
      # included) lose their fingerprints, so cargo builds them from this
      # clone's sources whatever the files' times (a cache saved after
      # this clone was made would otherwise look newer than its sources).
      find target -maxdepth 5 -path '*/.fingerprint/harness*' -prune -exec rm -rf {} +
      echo "restored target/ from $cache/target ($(du -sh target | cut -f1)), the workspace's crates to rebuild"
    else
      echo "no build cache at $cache/target yet: building from scratch"
    fi ;;
  save)
    # The old cache goes first (under the lock no clone is reading it), so
    # the disk never holds two caches; a copy cut short leaves no cache,
    # never half of one.
    rm -rf "$cache/target" "$cache/target.new"
    mkdir -p "$cache/target.new"
    for d in target/*; do
      case "${d#target/}" in doc|tmp) continue ;; esac
      cp -a --reflink=auto "$d" "$cache/target.new/"
    done
    mv "$cache/target.new" "$cache/target"
    echo "saved target/ to $cache/target ($(du -sh "$cache/target" | cut -f1))" ;;
  *) echo "usage: scripts/build-cache.sh restore|save" >&2; exit 2 ;;
esac
