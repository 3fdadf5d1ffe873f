"""hvd_sparse: gradient sparsification as a plug-in of Horovod.

Framework-agnostic parts live here (``hvd_sparse.Compression``, ``hvd_sparse.core``,
``hvd_sparse.testing``); the framework adapters are ``hvd_sparse.torch`` (and ``hvd_sparse.tensorflow``).
"""

__version__ = "0.1.0.dev0"

from .compression import Compression, SparseCompression  # noqa: E402
from .core.errors import NonFiniteGradientError, RankDisagreementError, ReplicaDivergenceError  # noqa: E402
from .core.oktopk import ThresholdReuse  # noqa: E402
from .core.sparsifiers import DCT, ExDyna, GaussianK, Sparsifier, TopK  # noqa: E402

__all__ = ["Compression", "SparseCompression", "DCT", "ExDyna", "GaussianK", "Sparsifier", "ThresholdReuse", "TopK",
           "NonFiniteGradientError", "RankDisagreementError", "ReplicaDivergenceError", "__version__"]
