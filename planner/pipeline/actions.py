"""What a rank does, one instruction at a time: `Action` and its kinds, with a compact text form.

Names: a *stage* is one entry of the plan's stages (index g, S of them in model order); a
*pipeline rank* runs v stages (S = p·v), or, replicated, one stage with r_g ranks ("lanes").
Communication actions carry a `batch` id: those with the same id stand together in one list and
are posted together (planner.pipeline.stepgraph states the semantics).
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Tuple

class ActionKind(enum.Enum):
    """What an action does. The value is the name traces and timelines record; `code` is the
    letter or word of the compact text form (`Action.__str__`)."""

    RECV_ACT = "recv_act"  # receive the activations a stage's forward needs
    FORWARD = "forward"
    SEND_ACT = "send_act"  # send them on to the next stage
    RECV_GRAD = "recv_grad"  # receive the gradients of the stage's outputs
    BACKWARD = "backward"
    # zero-bubble schedules split a backward in two: the gradients of the stage's inputs (what the
    # previous stage waits for), then those of its weights (which nothing waits for)
    BACKWARD_INPUT = "backward_input"
    BACKWARD_WEIGHT = "backward_weight"
    SEND_GRAD = "send_grad"  # send the gradients of its inputs back
    OPTIMIZER_STEP = "optimizer_step"  # once per step, after the rank's last backward

    @property
    def code(self) -> str:
        return _CODES[self]


_CODES = {ActionKind.FORWARD: "F", ActionKind.BACKWARD: "B", ActionKind.BACKWARD_INPUT: "I",
          ActionKind.BACKWARD_WEIGHT: "W", ActionKind.SEND_ACT: "SEND_F",
          ActionKind.RECV_ACT: "RECV_F", ActionKind.SEND_GRAD: "SEND_B", ActionKind.RECV_GRAD: "RECV_B",
          ActionKind.OPTIMIZER_STEP: "STEP"}
_KINDS = {code: kind for kind, code in _CODES.items()}
_TEXT = re.compile(r"(\d+)(F|B|I|W|SEND_F|RECV_F|SEND_B|RECV_B)(\d+)")


@dataclass(frozen=True)
class Action:
    """One instruction: what to do, for which micro-batch, of which stage.

    Text form: stage, code, micro-batch: "2F5" is stage 2's forward of micro-batch 5, "2B5" its
    backward, "2I5"/"2W5" its input and weight backward (torch's codes), "2SEND_F5"/"2RECV_F5" the
    activations' send/receive, "2SEND_B5"/"2RECV_B5" the
    gradients'; "STEP" the optimizer step. `Action.parse(str(a)) == a`."""

    kind: ActionKind
    micro_batch: int = -1  # -1: not about one micro-batch (the optimizer step)
    stage: int = 0
    # communication actions with the same id are posted together; -1: none (not part of equality
    # or the text form: it says how a list posts an action, not what the action is)
    batch: int = field(default=-1, compare=False)

    def __str__(self) -> str:
        if self.kind is ActionKind.OPTIMIZER_STEP:
            return self.kind.code
        return f"{self.stage}{self.kind.code}{self.micro_batch}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """The action `text` names (the form `str` writes); ValueError otherwise."""
        if text == ActionKind.OPTIMIZER_STEP.code:
            return cls(ActionKind.OPTIMIZER_STEP)
        match = _TEXT.fullmatch(text)
        if match is None:
            raise ValueError(f"{text!r} is not an action: write STAGE CODE MICRO_BATCH (e.g. 2F5, 0SEND_B3) or STEP")
        return cls(_KINDS[match.group(2)], int(match.group(3)), int(match.group(1)))


# what runs a micro-batch's backward through a stage: the whole, or its part that the previous stage waits for
BACKWARD_KINDS = (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT)
COMPUTE_KINDS = (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)
COMM_KINDS = (ActionKind.SEND_ACT, ActionKind.RECV_ACT, ActionKind.SEND_GRAD, ActionKind.RECV_GRAD)
SENDS = (ActionKind.SEND_ACT, ActionKind.SEND_GRAD)


def message_of(action: Action) -> Tuple[str, int, int]:
    """The message a communication action sends or receives: ("act" | "grad", boundary, micro-batch);
    boundary g lies between stages g and g + 1."""
    g, i = action.stage, action.micro_batch
    return {ActionKind.SEND_ACT: ("act", g, i), ActionKind.RECV_ACT: ("act", g - 1, i),
            ActionKind.SEND_GRAD: ("grad", g - 1, i), ActionKind.RECV_GRAD: ("grad", g, i)}[action.kind]


def peer_stage(action: Action) -> int:
    """The stage at the other end of a communication action's message."""
    return action.stage + (1 if action.kind in (ActionKind.SEND_ACT, ActionKind.RECV_GRAD) else -1)
