#!/bin/sh
# The image's install steps: deploy/docker/Dockerfile runs this script, and
# tests/deploy/test_image_install.py runs it too, in a fresh virtual environment, so the steps that
# build the image are tested where no container engine can build it.
#
#   install.sh cpu|cuda    from the directory holding pyproject.toml, with the target venv's
#                          `python` first on PATH
#
# TORCH_INDEX_URL: where the CPU build of torch comes from (PyPI's Linux wheel is the CUDA one, gigabytes
# larger); empty uses pip's own index configuration (a mirror, or the local wheels of our test machines).
set -eu

variant="${1:?usage: install.sh cpu|cuda}"
# The release the Makefile installs; keep the two in step.
torch_version="2.13.0"

torch_index="${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}"

python -m pip install --no-cache-dir --upgrade pip
case "$variant" in
  cpu)
    if [ -n "$torch_index" ]; then
      python -m pip install --no-cache-dir "torch==${torch_version}" --index-url "$torch_index"
    else
      python -m pip install --no-cache-dir "torch==${torch_version}"
    fi
    # Editable: manage.py and templates/ are read from the source tree, so there is one copy of the code.
    python -m pip install --no-cache-dir -e .
    ;;
  cuda)
    # vLLM pins the CUDA build of torch it was compiled against; let it choose.
    python -m pip install --no-cache-dir -e ".[vllm]"
    ;;
  *)
    echo "install.sh: unknown variant '$variant' (cpu or cuda)" >&2
    exit 2
    ;;
esac
# WhiteNoise serves the admin's and the portal's assets from STATIC_ROOT (var/static in the tree).
python manage.py collectstatic --no-input -v 0
