"""The kinds of pass the runtime tells apart."""

import enum


class PassKind(enum.Enum):
    """What kind of pass is running, decided by grad mode and autograd, never by ``nn.Module.training``."""
    FORWARD = "forward"  # forward with grad enabled: a backward may follow
    EVAL_FORWARD = "eval_forward"  # forward with grad disabled
    BACKWARD = "backward"  # everything the autograd engine runs, recomputation included

    @property
    def role(self) -> str:
        """``"forward"`` or ``"backward"``: which of the two prefetchers a pass of this kind has."""
        return "backward" if self is PassKind.BACKWARD else "forward"
