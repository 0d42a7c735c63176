"""vLLM's hidden-states connector for a host without CUDA: runs inside the vLLM server.

vLLM's ``extract_hidden_states`` speculative method caches the target's auxiliary hidden states
(``eagle_aux_hidden_state_layer_ids``) in a cache-only attention layer; a KV connector copies
them out when a request finishes. vLLM's example connector copies through pinned memory with
CUDA streams and events, which fail on a CPU build (``pin_memory=True requires a CUDA or other
accelerator backend``). This subclass keeps its scheduler side (file names, the per-file lock
that a reader waits on, ``kv_transfer_params["hidden_states_path"]`` in the response) and
replaces the copy: on CPU the cache already is host memory, so it is sliced and cloned, and on
CUDA the copy is synchronous. The file is written under a temporary name and renamed, so a
reader never sees half a file even without the lock.

The server loads it with ``--kv-transfer-config '{"kv_connector": "DFlashHiddenStatesConnector",
"kv_connector_module_path": "dflash_trainer.engines.vllm_hidden_states", ...}'`` and this
package on its ``PYTHONPATH``; nothing else of dflash-trainer is imported there.
"""

from __future__ import annotations

import fcntl
import os
from concurrent.futures import Future

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector, PendingSave, extract_from_kv_cache)

__all__ = ["DFlashHiddenStatesConnector"]


class _Copied:
    """Stands in for the CUDA event of the parent class: the copy is done when it is made."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class DFlashHiddenStatesConnector(ExampleHiddenStatesConnector):
    """The example connector with a synchronous device-to-host copy and atomic file writes."""

    @staticmethod
    def _write_tensors(tensors: dict[str, torch.Tensor], event: object, filename: str,
                       lock_fd: int | None) -> None:
        tmp = f"{filename}.tmp-{os.getpid()}"
        try:
            save_file(tensors, tmp)
            os.replace(tmp, filename)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: a reader waiting on LOCK_SH goes on

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets.view(1, -1) + blocks.view(-1, 1) * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]
        hidden = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), num_tokens)
        # clone(): the blocks are freed and reused once the request is reported finished.
        tensors = {"hidden_states": hidden.to("cpu").clone(), "token_ids": pending.token_ids.clone()}
        assert pending.req_id not in self._req_futures, "two writes for one request id"
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        future: Future = self._executor.submit(self._write_tensors, tensors, None, pending.filename,
                                               lock_fd)
        self._req_copy_events[pending.req_id] = _Copied()  # type: ignore[assignment]
        self._req_futures[pending.req_id] = future
        future.add_done_callback(lambda f, req_id=pending.req_id: self._on_write_done(req_id, f))
