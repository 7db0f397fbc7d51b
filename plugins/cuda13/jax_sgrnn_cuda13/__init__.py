"""jax_sgrnn's CUDA handler, packaged apart from it (the ``jax-sgrnn[cuda13]`` extra).

Nothing here is meant to be imported by users: ``jax_sgrnn`` imports ``_sgrnn_cuda`` from this
package when its own build has none, and checks that both come from the same release.
"""

from importlib.metadata import version

__version__ = version("jax-sgrnn-cuda13")
