#!/bin/sh
# Usage: replay/build.sh SITE_PACKAGES OUT_DIR
# Builds OUT_DIR/libtorchreplay.so against the torch wheel's headers and libc10.so
# (no CUDA header and no ninja needed).
set -eu
src="$(cd "$(dirname "$0")" && pwd)"
site="$1"
out="$2"
mkdir -p "$out"
g++ -O2 -std=c++17 -fPIC -shared -D_GLIBCXX_USE_CXX11_ABI=1 -I"$site/torch/include" \
    -o "$out/libtorchreplay.so" "$src/replay_core.cpp" -L"$site/torch/lib" -lc10 -Wl,-rpath,"$site/torch/lib"
