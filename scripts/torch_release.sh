# Sourced by scripts/test_torch.sh and scripts/test_torchtitan.sh: a venv with torch $TORCH from the
# package index and a copy of the working tree built against it, beside the main tree.
#
#   build/torch-X.Y.Z/venv   the venv (its default Linux wheel: the CUDA build, several GB) with the
#                            test dependencies;
#   build/torch-X.Y.Z/src    a copy of the working tree (tracked and untracked, not ignored files),
#                            built there, so the main tree's modules and build/cmake stay untouched;
#   build/torch-X.Y.Z/*.log  the download and build logs.
#
# Expects TORCH (X.Y.Z) and the caller's name in WHO; sets WORK, VENV, SRC, torch_build and the
# times t0 (start), t1 (venv ready), t2 (built). Safe to rerun: the venv is kept, the copy is
# refreshed and rebuilt incrementally. MAX_JOBS (default 1) and nice keep the build from crowding
# a shared machine.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
[[ $TORCH =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || { echo "$WHO: TORCH=$TORCH is not a release number X.Y.Z" >&2; exit 2; }
WORK=$ROOT/build/torch-$TORCH
VENV=$WORK/venv
SRC=$WORK/src
PY=${PYTHON:-python3}
mkdir -p "$WORK"
now() { date +%s; }

# 1. The venv. PIP_CONFIG_FILE=/dev/null: a machine-wide pip constraint (some machines here cap
# torch at the releases they keep on disk) must not stop the release asked for.
t0=$(now)
if [ ! -f "$VENV/.torch-$TORCH" ]; then
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  # A current pip first: the venv's own (23.x here) falls back to a legacy editable install that
  # builds in isolation, without torch.
  PIP_CONFIG_FILE=/dev/null "$VENV/bin/python" -m pip -q --disable-pip-version-check install --upgrade \
    pip setuptools wheel >"$WORK/download.log" 2>&1
  PIP_CONFIG_FILE=/dev/null nice -n 19 "$VENV/bin/python" -m pip -q --disable-pip-version-check install \
    "torch==$TORCH" >>"$WORK/download.log" 2>&1
  # Everything else requirements.txt lists, except its torch pin and the Hugging Face extra.
  grep -v -E '^(torch|transformers)[=<> ]' requirements.txt >"$WORK/requirements.txt"
  PIP_CONFIG_FILE=/dev/null nice -n 19 "$VENV/bin/python" -m pip -q --disable-pip-version-check install \
    "torch==$TORCH" -r "$WORK/requirements.txt" >>"$WORK/download.log" 2>&1
  touch "$VENV/.torch-$TORCH"
fi
t1=$(now)
torch_build=$("$VENV/bin/python" -c "import torch; print(torch.__version__, 'cuda', torch.version.cuda)")

# 2. The copy of the tree and its build (build/cmake inside the copy).
mkdir -p "$SRC"
# (tar, not rsync: rsync is not on every machine; a tracked file deleted in the tree is skipped.)
# Only files whose content differs are written, as new files: a file the tree changed (a merge,
# a checkout) may carry an mtime older than the object built from its previous content, and a
# copy keeping that mtime would leave the build stale.
STAGE=$(mktemp -d)
git ls-files -co --exclude-standard -z | tar --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -xf - -C "$STAGE"
(cd "$STAGE" && find . -type f -print0) | while IFS= read -r -d '' f; do
  if ! cmp -s "$STAGE/$f" "$SRC/$f"; then
    mkdir -p "$(dirname "$SRC/$f")" && rm -f "$SRC/$f" && cp "$STAGE/$f" "$SRC/$f"
  fi
done
rm -rf "$STAGE"
(cd "$SRC" && MAX_JOBS=${MAX_JOBS:-1} nice -n 19 "$VENV/bin/python" -m pip -q --disable-pip-version-check \
  install --no-build-isolation --no-deps -e . >"$WORK/build.log" 2>&1) || {
  echo "$WHO: the build against torch $TORCH failed; see $WORK/build.log" >&2; tail -30 "$WORK/build.log" >&2; exit 1; }
t2=$(now)
