#!/bin/bash
# Here, once before a lent GPU session: the pieces lent_session.sh carries
# (its header says why). Needs the package registry; takes about 20 minutes
# on 2 cores. Writes .gpu/c1 ... .gpu/c5 (TensorFlow 2.21 cp312, stripped,
# xz -9, in five parts of about 52 MB), .gpu/small and .whl, all git-ignored
# through .git/info/exclude.
set -eu
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >> .git/info/exclude
grep -qx '/.whl/' .git/info/exclude || echo /.whl/ >> .git/info/exclude
work=${WORK:-/tmp/gpu_pieces}
mkdir -p "$work" .gpu/small .whl
get() {  # cp312 manylinux wheels, no dependencies
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform any -d "$@"
}
get "$work" tensorflow==2.21.0
get .gpu/small nvidia-cuda-runtime-cu12 astunparse==1.6.3 gast==0.7.0 google-pasta==0.2.0 \
  termcolor==3.3.0 protobuf==7.36.2 ml_dtypes==0.6.0
get .whl keras==3.15.1 namex==0.1.0 optree==0.20.0 dp-accounting==0.6.0 dm-tree==0.1.10
rm -rf "$work/site" && mkdir "$work/site"
unzip -q "$work"/tensorflow-2.21.0-*.whl -d "$work/site" -x 'tensorflow/include/*' \
  'tensorflow/python/profiler/internal/_pywrap_profiler_plugin*'
find "$work/site" -name '*.so*' -type f -exec strip --strip-unneeded {} +
tar -C "$work/site" -c . | xz -9 -T0 > "$work/tf.txz"
rm -rf .gpu/c1 .gpu/c2 .gpu/c3 .gpu/c4 .gpu/c5
(cd "$work" && rm -f p? && split -n 5 -d -a 1 tf.txz p)
for k in 1 2 3 4 5; do mkdir -p .gpu/c$k; mv "$work/p$((k - 1))" .gpu/c$k/; done
du -sh .gpu/* .whl
