# Usage: gen.py SITE_PACKAGES OUT_DIR
# Writes OUT_DIR/cudart_generic.c: a "return 0" stub for every libcudart symbol the torch
# libraries in SITE_PACKAGES import that cudart_stub.c does not implement by hand; and
# OUT_DIR/driver_generic.c: the same for the driver symbols libcaffe2_nvrtc.so imports
# that driver_stub.c lacks. Generated per torch build, so not kept in the repository.
import os, re, subprocess, sys, glob
site, out_dir = sys.argv[1], sys.argv[2]
here = os.path.dirname(os.path.abspath(__file__))


def write_generic(name, label, symbols):
    """OUT_DIR/NAME: a traced "return 0" stub for each symbol, sorted."""
    with open(os.path.join(out_dir, name), "w") as o:
        o.write("#include <stdio.h>\n#include <stdlib.h>\n")
        o.write("static void tr(const char *n) { if (getenv(\"STUB_CUDA_TRACE\")) fprintf(stderr, \"[stubcuda] %s %%s\\n\", n); }\n" % label)
        for sym in sorted(symbols):
            o.write(f"int {sym}(void) {{ tr(\"{sym}\"); return 0; }}\n")


want = set()
for f in glob.glob(site + "/torch/lib/*.so*") + glob.glob(site + "/torch/_C*.so"):
    out = subprocess.run(["nm", "-D", "--undefined-only", f], capture_output=True, text=True).stdout
    for line in out.splitlines():
        m = re.search(r"(\S+)@libcudart\.so\.13", line)
        if m: want.add(m.group(1))
have = set(re.findall(r"^\S.*?\b(\w+)\s*\(", open(os.path.join(here, "cudart_stub.c")).read(), re.M))
write_generic("cudart_generic.c", "generic", want - have)
print(len(want), "wanted,", len(want - have), "generic")
# driver symbols imported by libcaffe2_nvrtc (loaded lazily by ATen)
want = set()
out = subprocess.run(["nm", "-D", "--undefined-only", site + "/torch/lib/libcaffe2_nvrtc.so"], capture_output=True, text=True).stdout
for line in out.splitlines():
    m = re.search(r"\s(cu[A-Z]\w*)$", line)
    if m and not m.group(1).startswith("cuFile"): want.add(m.group(1))
have = set(re.findall(r"^CUresult\s+(\w+)\s*\(", open(os.path.join(here, "driver_stub.c")).read(), re.M))
write_generic("driver_generic.c", "generic driver", want - have)
print(len(want), "driver wanted,", len(want - have), "generic", sorted(want-have))
