"""hintflow on an unmodified vLLM: a scheduler subclass (``--scheduler-cls``) that enforces hintflow hints,
and the ``PushHints`` gRPC service served from inside vLLM's engine-core process. See README.md here.

Nothing here imports vLLM at module import time except ``_scheduler`` (which vLLM itself loads), so the
package imports and type-checks where vLLM is absent.
"""
