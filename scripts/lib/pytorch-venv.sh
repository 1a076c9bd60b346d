# The PyTorch venv that the comparison scripts share (.venv-pytorch unless PYTORCH_VENV says
# otherwise): torch as its users install it from PyPI, with its Python dependencies and CUDA
# libraries (about 4.6 GB), torchvision, h5py and numpy. The libtorch in .venv cannot serve: it
# is torch without those, so Python cannot import it.
#
#   source scripts/lib/pytorch-venv.sh
#   ensure_pytorch_venv "$VENV" || echo "no PyTorch here"
#
# Sourced by compare-pytorch.sh and compare-optim-pytorch.sh (on first use), and by test.sh,
# which installs it in the background while the builds run (tests/optim_pytorch.rs needs it).

# torch is the version tch 0.24 binds (HPC_TRAIN_TORCH_VERSION of env.sh); torchvision is the
# one released with it (the vit-tiny rows build torchvision's VisionTransformer).
PYTORCH_VENV_TORCH=2.11.0
PYTORCH_VENV_TORCHVISION=0.26.0

# pytorch_venv_ok VENV: whether VENV imports torch, torchvision, h5py and numpy, at those versions.
pytorch_venv_ok() {
    local python="$1/bin/python"
    [ -x "$python" ] && "$python" -c "import sys, h5py, numpy, torch, torchvision; sys.exit(torch.__version__.split('+')[0] != '$PYTORCH_VENV_TORCH' or torchvision.__version__.split('+')[0] != '$PYTORCH_VENV_TORCHVISION')" 2>/dev/null
}

# ensure_pytorch_venv VENV: installs what VENV lacks (nothing when pytorch_venv_ok); returns
# non-zero, having said why on stderr, when it cannot.
ensure_pytorch_venv() {
    local venv="$1"
    pytorch_venv_ok "$venv" && return 0
    echo "==> installing torch $PYTORCH_VENV_TORCH, torchvision $PYTORCH_VENV_TORCHVISION, h5py and numpy into $venv (about 4.6 GB from PyPI, a minute or two)" >&2
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv" || { echo "python3 -m venv $venv failed (Debian: apt-get install python3-venv)" >&2; return 1; }
    fi
    printf '*\n' > "$venv/.gitignore"   # git ignores the venv wherever it lies
    # --no-cache-dir: the wheels would otherwise stay in ~/.cache/pip, a second 4.6 GB.
    "$venv/bin/pip" install --no-cache-dir -q "torch==$PYTORCH_VENV_TORCH" "torchvision==$PYTORCH_VENV_TORCHVISION" h5py numpy \
        || { echo "pip install into $venv failed" >&2; return 1; }
    pytorch_venv_ok "$venv" || { echo "the venv at $venv does not import torch $PYTORCH_VENV_TORCH, torchvision $PYTORCH_VENV_TORCHVISION, h5py and numpy" >&2; return 1; }
}
