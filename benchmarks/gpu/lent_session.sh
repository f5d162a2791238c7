#!/bin/bash
# One lent GPU session on a CUDA-13-only image with no package registry (this
# workplace's H100/H200): jax_privacy and this library on the same card.
# TensorFlow 2.21 is built for CUDA 12 and its wheel (573 MB) is far over
# what one call may carry (64 MiB), so it travels in pieces, and jax_privacy's
# rows run in the calls that carry them.
#
# Here, once (benchmarks/gpu/make_pieces.sh does it): the cp312 wheel of tensorflow==2.21.0 unzipped without
# tensorflow/include and the profiler plugin (90 MB), every .so stripped of
# its static symbol table (strip --strip-unneeded: .symtab and .strtab; the
# dynamic symbols stay), tar | xz -9, split -n 5 into .gpu/c1/p0 ...
# .gpu/c5/p4 (52 MB each); .gpu/small: nvidia-cuda-runtime-cu12 and
# TensorFlow's small pure-Python dependencies (astunparse, gast,
# google-pasta, termcolor, protobuf, ml_dtypes); .whl: keras, namex, optree,
# dp-accounting, dm-tree, jax-privacy, optax, pydantic and theirs.
# There, one call after the other (the machine is given back after 30 s idle):
#
#   bash benchmarks/gpu/lent_session.sh carry K [MODEL ...]
#       (carry .whl and .gpu/c1 the first time, .gpu/cK after) moves the
#       piece to /root/tfp and, for MODELs, runs jax_privacy's rows (JAX
#       Adam, make_private; the image's JAX, the carried Keras, no
#       TensorFlow in that environment);
#   bash benchmarks/gpu/lent_session.sh carry 5 && TF_ROWS="MODEL BATCH;..." \
#     FLOOR="--models ... --batch-sizes ..." bash benchmarks/gpu/lent_session.sh tf
#       (carry .gpu/c5 and .gpu/small) unpacks TensorFlow, links its CUDA 12
#       libraries to the image's CUDA 13 ones under TensorFlow's names (the
#       real libcudart.so.12; cuDNN 9 and NCCL 2 as they are), holds float32
#       results to float64 (check_gpu.py, TF32 off: a wrong link shows there),
#       then runs suite.py's Adam and DPAdamBC rows and noise_floor.py.
#
# Each call's results go to /root/res and that call's new files to $OUT
# (what comes back is capped in count).
set -u
T0=$(date +%s)
mkdir -p /root/tfp /root/res
OUT=${OUT:-/tmp/out}
quiet() { grep -v "^WARNING: All log\|port.cc\|^I0000\|^W0000\|cuda_dnn.cc\|cuda_blas.cc\|cuda_fft.cc"; }
STAMP=$(mktemp)
new_results() { find /root/res -type f -newer "$STAMP" -exec cp {} "$OUT"/ \; ; }
finish() { new_results; echo "call took $(( $(date +%s)-T0 )) s"; }
trap finish EXIT
mode=$1; shift
if [ "$mode" = carry ]; then
  k=$1; shift
  mv .gpu/c$k/* /root/tfp/ && ls -l /root/tfp | tail -n +2
  if [ ! -d /tmp/jsite ]; then  # .whl comes with the first call only
    cp -r .whl /root/whl
    python3 -m pip install -q --no-index --no-deps --target /tmp/jsite /root/whl/*.whl 2>&1 | tail -2
  fi
  # jax_privacy's processes: the image's JAX, the carried Keras, no TensorFlow.
  printf '#!/bin/sh\nexec env -u LD_LIBRARY_PATH PYTHONPATH=/tmp/jsite:%s python3 "$@"\n' "$PWD" > /tmp/jpy
  chmod +x /tmp/jpy
  if [ $# -gt 0 ]; then
    name=jaxp_$(echo "$@" | tr ' ' '_')
    PYTHONUNBUFFERED=1 timeout ${JAXP_S:-200} python3 benchmarks/suite.py --device gpu --no-tfp \
      --jaxp-python /tmp/jpy --configs "JAX Adam (non-private)" "jax_privacy make_private" \
      --models "$@" --batch-sizes 256 1024 --budget 1 --hard-budget 3 --max-steps 20 \
      --json /root/res/$name.json 2>&1 | quiet > /root/res/$name.log
    tail -14 /root/res/$name.log
  fi
  exit 0
fi
[ "$mode" = tf ] || { echo "usage: carry K [MODEL ...] | tf"; exit 2; }
mkdir -p /tmp/site /tmp/cu12
cat /root/tfp/p* | xz -d -T0 | tar -x -C /tmp/site || { echo UNPACK FAILED; exit 3; }
printf 'def _left_out(*args, **kwargs):\n  raise NotImplementedError("profiler plugin left out")\nmonitor = trace = start_server = _left_out\n' \
  > /tmp/site/tensorflow/python/profiler/internal/_pywrap_profiler_plugin.py
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site \
  .gpu/small/*.whl /root/whl/keras-*.whl /root/whl/namex-*.whl /root/whl/optree-*.whl \
  /root/whl/dp_accounting-*.whl /root/whl/dm_tree-*.whl 2>&1 | tail -2
echo "unpacked and installed after $(( $(date +%s)-T0 )) s"
python3 - <<'P'
import glob, os, site, zipfile
whl = glob.glob(".gpu/small/nvidia_cuda_runtime_cu12-*.whl")[0]
with zipfile.ZipFile(whl) as z:
  for n in z.namelist():
    if n.endswith("libcudart.so.12"):
      open("/tmp/cu12/libcudart.so.12", "wb").write(z.read(n))
found = {}
for root in site.getsitepackages() + ["/usr/local/cuda/lib64",
                                      "/usr/local/cuda/targets/x86_64-linux/lib"]:
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
export LD_LIBRARY_PATH=/tmp/cu12:$(cat /tmp/cu12/dirs) PYTHONPATH=/tmp/site:$PWD
export PATH=/usr/local/cuda/bin:$PATH XLA_FLAGS=--xla_gpu_cuda_data_dir=/usr/local/cuda
timeout 120 python3 benchmarks/gpu/check_gpu.py 2>&1 | quiet | tee /root/res/check_gpu.log | tail -3
grep -q "relative errors" /root/res/check_gpu.log || { echo "GPU CHECK FAILED"; exit 4; }
echo "checked after $(( $(date +%s)-T0 )) s"
# TF_ROWS: ';'-separated suite.py runs ("MODEL BATCH [K]": K steps per
# execution, default 1), then the noise floor.
IFS=';' read -ra rows <<< "${TF_ROWS:-transformer 1024}"
for row in "${rows[@]}"; do
  set -- $row
  k=${3:-1}; name=tf_$1_$2$([ "$k" = 1 ] || echo _spe$k)
  PYTHONUNBUFFERED=1 timeout ${TF_S:-200} python3 benchmarks/suite.py --device gpu --fresh --no-tfp \
    --configs Adam DPAdamBC --models $1 --batch-sizes $2 --budget 1 --hard-budget 3 \
    --max-steps 20 --steps-per-execution $k --timeout 150 --json /root/res/$name.json 2>&1 \
    | quiet > /root/res/$name.log
  tail -3 /root/res/$name.log
  echo "after $row: $(( $(date +%s)-T0 )) s"
  new_results
done
if [ -n "${FLOOR:-}" ]; then
  PYTHONUNBUFFERED=1 timeout ${FLOOR_S:-200} python3 benchmarks/noise_floor.py $FLOOR 2>&1 | quiet \
    > /root/res/noise_floor.log
  tail -20 /root/res/noise_floor.log
fi
