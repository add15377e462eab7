#!/usr/bin/env bash
# The build cache of ./x test, outside the clone:
#   scripts/build-cache.sh restore   copies the cache to target/ (if there is one)
#   scripts/build-cache.sh save      makes target/'s third-party units the cache
#                                    (nothing written when they are the same)
# The cache holds the third-party units of one target/ folder (wasmtime,
# cranelift, tch, ...: about 3 GB) at ${HARNESS_CACHE:-~/.cache/harness}/target,
# replaced as a whole on each save. The workspace's own units are never
# copied either way (scripts/build-cache.py): a clone rebuilds them anyway,
# and keeping them made the cache grow by a build on every save until a copy
# filled the disk. Copies keep modification times (cargo compares the
# dependencies' with their sources') and are taken under a lock, so two
# clones on one machine do not mix halves of two builds. A restore that does
# not fit on the disk, or fails, leaves no target/ behind and the build starts
# from scratch; it never fails the run. Old versions of updated dependencies
# ride along from save to save; past 6 GiB the cache is dropped and the next
# fresh clone saves a clean one.
set -euo pipefail
cd "$(dirname "$0")/.."
cache=${HARNESS_CACHE:-$HOME/.cache/harness}
mkdir -p "$cache"
exec 9> "$cache/target.lock"
flock 9
case "${1:-}" in
  restore)
    if [ -d "$cache/target" ]; then
      # Room for the copy and for the workspace's own build beside it (a
      # size that cannot be read leaves the copy to fail and say why).
      need=$(python3 scripts/build-cache.py --size "$cache/target") || need=0
      need=$((need + 6 * 1024 * 1024 * 1024))
      free=$(df -P -B1 . | awk 'NR == 2 { print $4 }')
      if [ "$free" -lt "$need" ]; then
        echo "build cache not restored: $((free >> 20)) MiB free here, $((need >> 20)) MiB needed" \
             "(the cache and 6 GiB for the build); building from scratch"
      elif python3 scripts/build-cache.py "$cache/target" target; then
        echo "restored target/ from $cache/target ($(du -sh target | cut -f1)), the workspace's crates to rebuild"
      else
        rm -rf target
        echo "build cache: the copy failed (above); building from scratch"
      fi
    else
      echo "no build cache at $cache/target yet: building from scratch"
    fi ;;
  save)
    # Nothing to write when the cache holds target/'s third-party units as
    # they are (no dependency was built again: the usual run).
    if [ -d "$cache/target" ] && python3 scripts/build-cache.py --same target "$cache/target"; then
      echo "build cache unchanged: target/'s third-party units are those of $cache/target"
      exit 0
    fi
    # The old cache goes first (under the lock no clone is reading it), so
    # the disk never holds two caches; a copy cut short leaves no cache,
    # never half of one.
    rm -rf "$cache/target" "$cache/target.new"
    # A dependency updated leaves its old units beside the new ones (a
    # restored cache carries them on): past 6 GiB the cache is dropped, and
    # the next fresh clone builds from scratch and saves a clean one.
    # (A size that cannot be read leaves the copy to fail and say why.)
    have=$(python3 scripts/build-cache.py --size target) || have=0
    if [ "$have" -gt $((6 * 1024 * 1024 * 1024)) ]; then
      echo "build cache dropped: target/'s third-party units take $((have >> 20)) MiB (more than 6 GiB: old versions piled up); the next fresh clone builds from scratch"
    elif python3 scripts/build-cache.py target "$cache/target.new"; then
      mv "$cache/target.new" "$cache/target"
      echo "saved target/'s third-party units to $cache/target ($(du -sh "$cache/target" | cut -f1))"
    else
      # A full disk must not fail checks that passed: no cache this time.
      rm -rf "$cache/target.new"
      echo "build cache not saved: the copy failed (above); the next fresh clone builds from scratch"
    fi ;;
  *) echo "usage: scripts/build-cache.sh restore|save" >&2; exit 2 ;;
esac
