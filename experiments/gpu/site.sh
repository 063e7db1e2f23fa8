# Sourced by the device scripts (session.sh, trainer.sh), from the repository root: the packages the GPU
# image lacks, installed once from the carried wheels (.whl, made by carry.sh) into /tmp/site, which every
# later python3 of the call then finds on PYTHONPATH (a child's export would not reach its parent).
if [ -d .whl ] && [ ! -f /tmp/site/.vitmm_installed ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && touch /tmp/site/.vitmm_installed || echo "FAILED: installing the carried wheels"
fi
if [ -d /tmp/site ] && [[ ":${PYTHONPATH:-}:" != *":/tmp/site:"* ]]; then
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# the loop checks compile each step twice (the loop, then the bare step): the second is read back from here
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/vitmm_jax_cache}
