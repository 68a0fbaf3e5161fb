#!/bin/sh
# Usage: stub/build.sh SITE_PACKAGES OUT_DIR
# Builds the stub driver (libcuda.so.1), runtime (libstubcudart.so, SONAME libcudart.so.13)
# and NVML (libnvidia-ml.so.1) into OUT_DIR, against the CUDA headers that PyPI's
# nvidia-cuda-runtime wheel installs under SITE_PACKAGES/nvidia/*/include (cuda.h and
# cuda_runtime_api.h; crt/host_defines.h, which that wheel lacks, is the shim in inc/).
set -eu
src="$(cd "$(dirname "$0")" && pwd)"
site="$1"
out="$2"
mkdir -p "$out"
inc=""
for h in cuda_runtime_api.h cuda.h; do
    f="$(find "$site/nvidia" -name "$h" -path '*/include/*' 2>/dev/null | sort | head -n 1)"
    if [ -z "$f" ]; then
        echo "stub/build.sh: no $h under $site/nvidia (the nvidia-cuda-runtime wheel ships it)" >&2
        exit 3
    fi
    case " $inc " in *" -I$(dirname "$f") "*) ;; *) inc="$inc -I$(dirname "$f")" ;; esac
done
python3 "$src/gen.py" "$site" "$out"
cd "$out"
gcc -O2 -fPIC -shared -Wall -I"$src/inc" $inc -o libcuda.so.1 "$src/driver_stub.c" driver_generic.c \
    -Wl,-soname,libcuda.so.1 -lpthread
gcc -O2 -fPIC -shared -Wall -Wno-misleading-indentation -I"$src/inc" $inc -o libstubcudart.so \
    "$src/cudart_stub.c" cudart_generic.c -Wl,-soname,libcudart.so.13 -Wl,--version-script="$src/cudart.map" \
    -L. -l:libcuda.so.1 -Wl,-rpath,'$ORIGIN' -ldl -lpthread
gcc -O2 -fPIC -shared -Wall -o libnvidia-ml.so.1 "$src/nvml_stub.c" -Wl,-soname,libnvidia-ml.so.1
