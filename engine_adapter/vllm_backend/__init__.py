"""hintflow on an unmodified vLLM: scheduler subclasses (``--scheduler-cls``, one over each of vLLM's
schedulers, synchronous and async) that enforce hintflow hints, and the ``PushHints`` gRPC service served
from inside vLLM's engine-core process. See README.md here.

Nothing here imports vLLM at module import time except ``_scheduler`` (which vLLM itself loads), so the
package imports and type-checks where vLLM is absent.
"""
