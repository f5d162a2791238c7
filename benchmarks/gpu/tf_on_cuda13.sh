#!/bin/bash
# TensorFlow 2.21 (built for CUDA 12) on a GPU machine whose image has CUDA 13
# only and no package registry (this workplace's lent H100/H200): how
# benchmarks/results/2026-11-27-h200-tensorflow.json was measured.
#
# Here: pip download the cp312 wheels of tensorflow==2.21.0 (without
# tensorflow/include and the 90 MB profiler plugin, then tar | xz -6: 295 MB,
# carried in 62 MiB parts moved to /root/tfp one call at a time),
# nvidia-cuda-runtime-cu12 and TensorFlow's small pure-Python dependencies
# (astunparse, gast, google-pasta, termcolor, protobuf 7, ml_dtypes) into
# .gpu/small, and keras, namex, optree, dp-accounting, dm-tree into .whl.
# There, from the repository root:  bash benchmarks/gpu/tf_on_cuda13.sh
# then the suite (printed at the end).
#
# The shims: the real libcudart.so.12; cuBLAS(Lt), cuFFT, cuSOLVER, cuSPARSE
# and nvJitLink linked to the image's CUDA 13 libraries under TensorFlow's
# CUDA 12 names; cuDNN 9 and NCCL 2 as they are. check_gpu.py holds float32
# products, an XLA-compiled function and a convolution to float64 NumPy
# (TF32 off) before anything is timed: a wrong shim shows there.
set -u
mkdir -p /tmp/site /tmp/cu12
cat /root/tfp/part-* | xz -d -T0 | tar -x -C /tmp/site || exit 3
# Imported by tf.compat's API tree, used only by the profiler's client.
printf 'def _left_out(*args, **kwargs):\n  raise NotImplementedError("profiler plugin left out")\nmonitor = trace = start_server = _left_out\n' \
  > /tmp/site/tensorflow/python/profiler/internal/_pywrap_profiler_plugin.py
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site .gpu/small/*.whl .whl/keras-*.whl \
  .whl/namex-*.whl .whl/optree-*.whl .whl/dp_accounting-*.whl .whl/dm_tree-*.whl
python3 - <<'P'
import glob, os, site, zipfile
whl = glob.glob(".gpu/small/nvidia_cuda_runtime_cu12-*.whl")[0]
with zipfile.ZipFile(whl) as z:
  for n in z.namelist():
    if n.endswith("libcudart.so.12"):
      open("/tmp/cu12/libcudart.so.12", "wb").write(z.read(n))
found = {}
for root in site.getsitepackages() + ["/usr/local/cuda/lib64"]:
  for f in glob.glob(root + "/**/lib*.so.*", recursive=True):
    found.setdefault(os.path.basename(f), f)
shims = {"libcublas.so.12": "libcublas.so.1", "libcublasLt.so.12": "libcublasLt.so.1",
         "libcufft.so.11": "libcufft.so.1", "libcusolver.so.11": "libcusolver.so.1",
         "libcusparse.so.12": "libcusparse.so.1", "libnvJitLink.so.12": "libnvJitLink.so.1",
         "libcudnn.so.9": "libcudnn.so.9", "libnccl.so.2": "libnccl.so.2"}
for name, prefix in shims.items():
  candidates = sorted(b for b in found if b.startswith(prefix) and b.count(".") == 2)
  if not candidates:
    print("missing:", name)
    continue
  link = "/tmp/cu12/" + name
  if not os.path.lexists(link):
    os.symlink(found[candidates[-1]], link)
  print(name, "->", os.path.realpath(link))
dirs = {os.path.dirname(os.path.realpath("/tmp/cu12/" + n)) for n in os.listdir("/tmp/cu12")}
open("/tmp/cu12/dirs", "w").write(":".join(sorted(dirs)))
P
cat <<ENV > /tmp/cu12/env
export LD_LIBRARY_PATH=/tmp/cu12:$(cat /tmp/cu12/dirs) PYTHONPATH=/tmp/site:$PWD
export PATH=/usr/local/cuda/bin:\$PATH XLA_FLAGS=--xla_gpu_cuda_data_dir=/usr/local/cuda
ENV
. /tmp/cu12/env
python3 benchmarks/gpu/check_gpu.py || exit 4
echo ". /tmp/cu12/env; python3 benchmarks/suite.py --device gpu --fresh --no-tfp --configs Adam DPAdamBC"
