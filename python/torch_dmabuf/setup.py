"""torch_dmabuf: dmabuf-rt as a PyTorch device ("dmabuf", PrivateUse1).

Install into an environment that has torch:  pip install --no-build-isolation python/torch_dmabuf
The build compiles libdmabuf_rt with cargo from this checkout and the C++ glue with
torch.utils.cpp_extension; the package carries the library next to its extension.
"""
import os
import shutil
import subprocess

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
PKG = os.path.join(HERE, "torch_dmabuf")


def build_library():
    """Builds libdmabuf_rt.so (release) and copies it into the package."""
    subprocess.run(["cargo", "build", "--release", "--lib", "--quiet"], cwd=ROOT, check=True)
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    lib_dir = os.path.join(PKG, "lib")
    os.makedirs(lib_dir, exist_ok=True)
    shutil.copy2(os.path.join(target, "release", "libdmabuf_rt.so"), os.path.join(lib_dir, "libdmabuf_rt.so"))
    return lib_dir


class Build(BuildExtension):
    def run(self):
        lib = build_library()
        super().run()
        # The extension finds the library in lib/ beside it (its RUNPATH is $ORIGIN/lib).
        if not self.inplace:
            dest = os.path.join(self.build_lib, "torch_dmabuf", "lib")
            os.makedirs(dest, exist_ok=True)
            shutil.copy2(os.path.join(lib, "libdmabuf_rt.so"), os.path.join(dest, "libdmabuf_rt.so"))


lib_dir = os.path.join(PKG, "lib")
sources = sorted(os.path.join("csrc", f) for f in os.listdir(os.path.join(HERE, "csrc")) if f.endswith(".cpp"))

setup(
    name="torch_dmabuf",
    version="0.1.0",
    description="dmabuf-rt as a PyTorch PrivateUse1 device",
    packages=["torch_dmabuf"],
    package_data={"torch_dmabuf": ["lib/libdmabuf_rt.so"]},
    ext_modules=[
        CppExtension(
            "torch_dmabuf._C",
            sources,
            include_dirs=[os.path.join(ROOT, "include"), os.path.join(HERE, "csrc")],
            library_dirs=[lib_dir],
            libraries=["dmabuf_rt"],
            extra_compile_args=["-O2", "-g0"],
            extra_link_args=["-Wl,-rpath,$ORIGIN/lib"],
        )
    ],
    cmdclass={"build_ext": Build},
    zip_safe=False,
)
