"""Where the package meets a Trainer's callback list and its logging cadence (private Lightning API, one place).

Checked against lightning 2.5.6 and 2.6.6 (the same code in both):

- ``_CallbackConnector.on_trainer_init`` builds ``trainer.callbacks`` in ``Trainer.__init__`` (the strategy, and so its
  CheckpointIO, is set up before it), and ``_CallbackConnector._attach_model_callbacks`` adds the model's
  ``configure_callbacks`` at the start of every ``fit``/``validate``/``test``/``predict``, before any ``setup`` hook.
  :func:`after_callbacks_configured` runs a function after each of the two, so that a Trainer whose strategy saves
  through the plugin gets its callback, and no other Trainer sees anything of this package (an entry point under
  ``lightning.pytorch.callbacks_factory`` would add it to every Trainer of the environment).
- ``_LoggerConnector.should_update_logs`` says whether the current training step is one where Lightning sends its
  rows to the loggers (``log_every_n_steps``): :func:`is_logging_step`.

Call order: :func:`after_callbacks_configured` when a plugin is made (any thread, idempotent); the wrapped methods run
where Lightning calls them, on the thread that makes the Trainer or runs ``fit``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.trainer.connectors.callback_connector import _CallbackConnector

#: Marks a wrapped method, so that it is wrapped once per process.
_WRAPPED = "_lightning_datastates_wrapped"
#: The functions run after the callback list is (re)built, in registration order.
_AFTER: list[Callable[[Trainer], None]] = []


def after_callbacks_configured(hook: Callable[[Trainer], None]) -> None:
    """Run ``hook(trainer)`` each time Lightning builds ``trainer.callbacks`` (Trainer init) or adds the model's own
    (start of every ``fit``/``validate``/``test``/``predict``); once per distinct ``hook``. ``hook`` must be idempotent:
    it runs several times per Trainer."""
    if hook not in _AFTER:
        _AFTER.append(hook)
    for name in ("on_trainer_init", "_attach_model_callbacks"):
        original = getattr(_CallbackConnector, name)
        if not getattr(original, _WRAPPED, False):
            setattr(_CallbackConnector, name, _run_hooks_after(original))


def _run_hooks_after(original: Callable[..., None]) -> Callable[..., None]:
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        for hook in list(_AFTER):
            hook(self.trainer)

    setattr(wrapped, _WRAPPED, True)
    wrapped.__name__ = original.__name__
    wrapped.__doc__ = original.__doc__
    return wrapped


def is_logging_step(trainer: Trainer) -> bool:
    """Whether Lightning sends its logged values to the loggers at the current training step (``log_every_n_steps``).

    Exact in ``on_train_batch_end`` (as Lightning's own ``LearningRateMonitor`` uses it in ``on_train_batch_start``);
    False where the Trainer has no logger connector (a Trainer half made).
    """
    connector = getattr(trainer, "_logger_connector", None)
    return bool(connector is not None and connector.should_update_logs)
