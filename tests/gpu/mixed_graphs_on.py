"""pytest plugin: `python -m pytest -p tests.gpu.mixed_graphs_on ...` builds every CUDA backend of
the run with levers.mixed_graphs=true (to run the existing GPU tests through the mixed graphs)."""
from omegaconf import OmegaConf

from metrale.runtime import cuda_backend

_init = cuda_backend.CudaBackend.__init__


def _init_mixed_on(self, config, weights, *, cfg, **kwargs):
    _init(self, config, weights, cfg=OmegaConf.merge(cfg, {"levers": {"mixed_graphs": True}}), **kwargs)


cuda_backend.CudaBackend.__init__ = _init_mixed_on
