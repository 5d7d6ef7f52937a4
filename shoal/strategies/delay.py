"""Delay compensation for pushed gradients (DC-ASGD, Zheng et al. 2017).

Zheng, Meng, Wang, Chen, Yu, Ma & Liu (2017), "Asynchronous Stochastic Gradient Descent with
Delay Compensation" (ICML). A worker ``m`` computes ``g(w_t)`` at the parameters it last
received, ``w_bak(m) = w_t``; by the time its push arrives the server holds ``w_{t+tau}``.
The first-order Taylor expansion of the gradient at ``w_{t+tau}``, with the Hessian
approximated by ``lambda g (.) g`` (the diagonal of the gradients' outer product), gives the
compensated gradient the server applies instead of ``g``::

    g~ = g + lambda_t g (.) g (.) (w_{t+tau} - w_bak(m))          # (.): elementwise
    w_bak(m) <- the parameters sent to worker m (its pull, or the reply to its push)

DC-ASGD-a, the adaptive form used here: ``lambda_t = lambda_0 / sqrt(MeanSquare(t))``,
elementwise, with ``MeanSquare(t) = m MeanSquare(t - 1) + (1 - m) g (.) g`` (``m = 0.95``
as in the paper; ``1e-7`` added to the root keeps it finite where the gradients are
zero). ``lambda_0 = 0`` is plain asynchronous SGD. The server keeps one ``w_bak`` per pusher
(the pushers' count bounds the memory: one shard's copy each) and one ``MeanSquare``; a
checkpoint keeps ``MeanSquare`` only: every worker of a resumed job pulls before it pushes,
which sets its ``w_bak`` again. A pusher with no ``w_bak`` yet is not compensated.
"""

from __future__ import annotations

import torch

#: The paper's decay of the gradients' mean square, ``m`` (DC-ASGD-a).
MEAN_SQUARE_DECAY = 0.95
EPSILON = 1e-7


class DelayCompensation:
    """One shard's DC-ASGD-a state: each pusher's ``w_bak`` and the mean square of the
    gradients. Called under the shard's lock (the rules that use it are locked)."""

    def __init__(self, center: torch.Tensor, lambda0: float) -> None:
        self.center, self.lambda0 = center, lambda0
        self.backups: dict[int, torch.Tensor] = {}
        self.mean_square = torch.zeros_like(center)
        self._term = torch.empty_like(center)
        self._root = torch.empty_like(center)  # sqrt(MeanSquare) + eps, no allocation a push

    def sent(self, client: int) -> None:
        """The center was just sent to ``client``: its next gradient is taken there."""
        backup = self.backups.get(client)
        if backup is None:
            self.backups[client] = self.center.clone()
        else:
            backup.copy_(self.center)

    def forget(self, client: int) -> None:
        """``client`` left or was lost: its copy is freed."""
        self.backups.pop(client, None)

    @torch.no_grad()
    def compensate(self, client: int, g: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = g + lambda_t g (.) g (.) (w - w_bak(client))``; returns ``out``."""
        self.mean_square.mul_(MEAN_SQUARE_DECAY).addcmul_(g, g, value=1 - MEAN_SQUARE_DECAY)
        backup = self.backups.get(client)
        if backup is None:
            return out.copy_(g)
        term = torch.sub(self.center, backup, out=self._term).mul_(g).mul_(g)
        term.div_(torch.sqrt(self.mean_square, out=self._root).add_(EPSILON)).mul_(self.lambda0)
        return torch.add(g, term, out=out)

    def state_dict(self) -> dict:
        return {"mean_square": self.mean_square.clone()}

    def load_state_dict(self, state: dict) -> None:
        if "mean_square" in state:
            self.mean_square.copy_(state["mean_square"])
