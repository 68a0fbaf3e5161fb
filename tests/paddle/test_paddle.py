"""The real paddlepaddle wheel on dmabuf-rt's custom-runtime plugin.

Run by tests/paddle/run, which sets CUSTOM_DEVICE_ROOT to a directory holding the plugin
(libdmabuf_rt.so) and DMABUF_RT_LIB to the same file. Two devices (DMABUF_RT_DEVICES=shmem,shmem)
with a capacity of DMABUF_RT_CAPACITY each; the allocator's own stats are read through the
library's C API (ctypes on the very library Paddle loaded, so the same runtime).
"""

import ctypes
import gc
import os
import subprocess
import sys
import unittest

import numpy as np

os.environ.setdefault("DMABUF_RT_DEVICES", "shmem,shmem")
os.environ.setdefault("DMABUF_RT_CAPACITY", "1G")

import paddle  # noqa: E402  (the environment above must be set before the plugin loads)

LIB = ctypes.CDLL(os.environ["DMABUF_RT_LIB"])
CAPACITY = 1 << 30


class Stats(ctypes.Structure):
    """`dmabuf_rt_stats` from include/dmabuf_rt.h (filled by `dmabuf_rt_device_stats`)."""

    _fields_ = [
        (name, ctypes.c_uint64)
        for name in [
            "allocated_bytes",
            "peak_allocated_bytes",
            "reserved_bytes",
            "peak_reserved_bytes",
            "requested_bytes",
            "allocations",
            "num_allocs",
            "num_frees",
            "num_ooms",
            "num_alloc_retries",
            "num_backend_allocs",
            "num_backend_frees",
            "capacity_bytes",
            "limbo_bytes",
        ]
    ]


def stats(device=0):
    f = LIB.dmabuf_rt_device_stats
    f.argtypes = [ctypes.c_int, ctypes.POINTER(Stats)]
    f.restype = ctypes.c_int
    s = Stats()
    assert f(device, ctypes.byref(s)) == 0
    return s


def place(i=0):
    return paddle.CustomPlace("dmabuf", i)


class PluginLoads(unittest.TestCase):
    def test_the_device_type_and_both_devices_are_visible(self):
        self.assertIn("dmabuf", paddle.device.get_all_custom_device_type())
        self.assertEqual(paddle.device.get_available_custom_device().count("dmabuf:0"), 1)
        self.assertIn("dmabuf:1", paddle.device.get_available_custom_device())


class RoundTrips(unittest.TestCase):
    def setUp(self):
        paddle.set_device("dmabuf:0")

    def check(self, dtype, n):
        rng = np.random.default_rng(n)
        if dtype == "bool":
            a = rng.integers(0, 2, n).astype(bool)
        elif dtype == "int8":
            a = rng.integers(-128, 128, n).astype(np.int8)
        elif dtype == "bfloat16":
            # Exactly representable values; numpy() gives bfloat16 as its raw uint16 bits.
            a = rng.integers(-256, 256, n).astype(np.float32)
            t = paddle.to_tensor(a, dtype="bfloat16", place=place())
            got = t.numpy()
            want = (a.view(np.uint32) >> 16).astype(np.uint16)
            self.assertTrue(np.array_equal(got.view(np.uint16), want), f"bfloat16 x {n}")
            return
        else:
            a = rng.standard_normal(n).astype(dtype)
        t = paddle.to_tensor(a, place=place())
        self.assertEqual(str(t.place), "Place(dmabuf:0)")
        self.assertTrue(np.array_equal(t.numpy(), a), f"{dtype} x {n}")

    def test_every_dtype_from_one_element_to_64_mib(self):
        for dtype, itemsize in [("float32", 4), ("float64", 8), ("int8", 1), ("bool", 1), ("bfloat16", 2)]:
            for n in [1, 3, 1000, 4097, (1 << 20) // itemsize + 5, (64 << 20) // itemsize]:
                with self.subTest(dtype=dtype, n=n):
                    self.check(dtype, n)


class Compute(unittest.TestCase):
    def test_x_plus_x_runs_through_the_cpu_fallback(self):
        paddle.set_device("dmabuf:0")
        x = paddle.to_tensor(np.arange(1000, dtype=np.float32))
        y = x + x
        self.assertEqual(str(y.place), "Place(dmabuf:0)")
        self.assertTrue(np.array_equal(y.numpy(), 2 * np.arange(1000, dtype=np.float32)))

    def test_copies_between_two_devices_blocking_and_not(self):
        a = np.arange(1 << 20, dtype=np.float32)
        for blocking in (True, False):
            for _ in range(10):
                x = paddle.to_tensor(a, place=place(0))
                y = x._copy_to(place(1), blocking)
                self.assertEqual(str(y.place), "Place(dmabuf:1)")
                if not blocking:
                    # Paddle queues a non-blocking peer copy on the destination's stream; like
                    # on CUDA, y is ready for another device's stream only once that is done.
                    paddle.device.synchronize("dmabuf:1")
                z = y._copy_to(place(0), blocking)
                if not blocking:
                    paddle.device.synchronize("dmabuf:0")
                self.assertTrue(np.array_equal(y.numpy(), a))
                self.assertTrue(np.array_equal(z.numpy(), a))


class Memory(unittest.TestCase):
    def test_empty_cache_returns_memory_to_our_allocator(self):
        paddle.set_device("dmabuf:0")
        gc.collect()
        paddle.device.empty_cache()
        base = stats().allocated_bytes
        xs = [paddle.to_tensor(np.ones(1 << 20, dtype=np.float32)) for _ in range(8)]
        self.assertGreaterEqual(stats().allocated_bytes, base + 8 * (4 << 20))
        del xs
        gc.collect()
        held = stats().allocated_bytes
        paddle.device.empty_cache()
        after = stats().allocated_bytes
        self.assertLess(after, held, "empty_cache gave nothing back to our allocator")
        self.assertEqual(after, base)

    def test_thousands_of_tensors_leave_our_stats_at_zero(self):
        paddle.set_device("dmabuf:0")
        gc.collect()
        paddle.device.empty_cache()
        base = stats()
        for i in range(3000):
            t = paddle.to_tensor(np.full(1 + i % 500, i, dtype=np.float32))
            del t
        gc.collect()
        paddle.device.empty_cache()
        now = stats()
        self.assertEqual(now.allocated_bytes, base.allocated_bytes)
        self.assertEqual(now.num_allocs - base.num_allocs, now.num_frees - base.num_frees)

    def test_an_allocation_over_the_capacity_is_a_python_error_and_paddle_goes_on(self):
        paddle.set_device("dmabuf:0")
        with self.assertRaises(Exception) as cm:
            paddle.zeros([CAPACITY // 4 + 1024], dtype="float32")  # just over 1 GiB
        self.assertIn("memory", str(cm.exception).lower())
        self.assertGreater(stats().num_ooms, 0)
        self.assertEqual(stats().capacity_bytes, CAPACITY)
        x = paddle.to_tensor(np.arange(10, dtype=np.float32))
        self.assertTrue(np.array_equal((x + x).numpy(), 2 * np.arange(10, dtype=np.float32)))


class NaiveBestFit(unittest.TestCase):
    def test_the_naive_best_fit_strategy_works(self):
        code = (
            "import numpy as np, paddle\n"
            "paddle.set_device('dmabuf:0')\n"
            "a = np.arange(3 << 20, dtype=np.float32)\n"
            "x = paddle.to_tensor(a)\n"
            "assert np.array_equal((x + x).numpy(), 2 * a)\n"
            "ys = [paddle.to_tensor(np.full(i + 1, i % 100, dtype=np.int8)) for i in range(1000)]\n"
            "assert all(int(y.numpy()[0]) == i % 100 and y.shape == [i + 1] for i, y in enumerate(ys))\n"
            "print('ok')\n"
        )
        env = dict(os.environ, FLAGS_allocator_strategy="naive_best_fit")
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        self.assertEqual(r.returncode, 0, r.stderr[-4000:])
        self.assertIn("ok", r.stdout)


if __name__ == "__main__":
    unittest.main(verbosity=2)
