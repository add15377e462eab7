#!/usr/bin/env bash
# Builds every strategy plugin (plugins/*) and test fixture (tests/plugins/*)
# twice from the same source: as a WebAssembly component (wasm32-wasip2) and
# as a native library, then copies them to
#
#   target/plugins/<name>.wasm   and   target/plugins/lib<name>.so
#
# with <name> = the package name minus `harness-plugin-` / `harness-fixture-`.
# A crate with `[package.metadata.harness] wasm = false` is built natively only.
#
# Usage: scripts/build-plugins.sh [--release | --debug]   (default: --release)
#
# One cargo invocation per target, with an explicit -p list, so the native
# build never builds the host crate (libtorch, wasmtime). Re-runs are
# incremental; unchanged artifacts are not copied again.
set -euo pipefail
cd "$(dirname "$0")/.."

profile=release
for arg in "$@"; do
  case "$arg" in
    --release) profile=release ;;
    --debug) profile=debug ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build-plugins: unknown argument \`$arg\` (use --release or --debug)" >&2; exit 2 ;;
  esac
done
cargo_profile=()
[ "$profile" = release ] && cargo_profile=(--release)

die() { echo "build-plugins: $*" >&2; exit 1; }

WASM_TARGET=wasm32-wasip2
if ! rustup target list --installed 2>/dev/null | grep -qx "$WASM_TARGET"; then
  echo "== installing the $WASM_TARGET target (once)"
  rustup target add "$WASM_TARGET" || die "could not install the $WASM_TARGET target"
fi

# Packages: every crate under plugins/ and tests/plugins/.
native_pkgs=()
wasm_pkgs=()
for manifest in plugins/*/Cargo.toml tests/plugins/*/Cargo.toml; do
  [ -f "$manifest" ] || continue
  pkg=$(sed -n 's/^name *= *"\(.*\)"/\1/p' "$manifest" | head -n 1)
  [ -n "$pkg" ] || die "no package name in $manifest"
  native_pkgs+=("$pkg")
  if ! grep -Eq '^wasm *= *false' "$manifest"; then
    wasm_pkgs+=("$pkg")
  fi
done
[ ${#native_pkgs[@]} -gt 0 ] || die "no plugin crates found under plugins/ or tests/plugins/"

target_dir=${CARGO_TARGET_DIR:-target}
out_dir="$target_dir/plugins"
mkdir -p "$out_dir"

p_args() { for p in "$@"; do printf -- '-p\n%s\n' "$p"; done; }

echo "== cargo build --target $WASM_TARGET ($profile): ${wasm_pkgs[*]}"
# Debug info stripped from components (names kept for trap backtraces): it
# is 90% of their size. Only wasm32 units see these settings.
mapfile -t args < <(p_args "${wasm_pkgs[@]}")
CARGO_PROFILE_RELEASE_DEBUG=false CARGO_PROFILE_RELEASE_STRIP=debuginfo \
  cargo build --target "$WASM_TARGET" "${cargo_profile[@]}" "${args[@]}" || die "the wasm build failed"

echo "== cargo build (native, $profile): ${native_pkgs[*]}"
mapfile -t args < <(p_args "${native_pkgs[@]}")
cargo build "${cargo_profile[@]}" "${args[@]}" || die "the native build failed"

case "$(uname -s)" in
  Darwin) dylib_ext=dylib ;;
  *) dylib_ext=so ;;
esac

# Copies $1 to $2 unless identical; prints the line for the summary.
install_artifact() {
  local src=$1 dst=$2
  [ -f "$src" ] || die "expected artifact $src is missing"
  if ! cmp -s "$src" "$dst" 2>/dev/null; then
    cp "$src" "$dst.tmp" && mv -f "$dst.tmp" "$dst"
  fi
  printf '  %-44s %10s bytes\n' "$dst" "$(wc -c < "$dst" | tr -d ' ')"
}

short_name() { local n=${1#harness-plugin-}; echo "${n#harness-fixture-}"; }

echo "== artifacts"
for pkg in "${wasm_pkgs[@]}"; do
  install_artifact "$target_dir/$WASM_TARGET/$profile/${pkg//-/_}.wasm" "$out_dir/$(short_name "$pkg").wasm"
done
for pkg in "${native_pkgs[@]}"; do
  install_artifact "$target_dir/$profile/lib${pkg//-/_}.$dylib_ext" "$out_dir/lib$(short_name "$pkg").$dylib_ext"
done
