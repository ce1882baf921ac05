"""The model and data the examples share: the demo's small GPT and a datamodule of random token blocks."""

from __future__ import annotations

import lightning as L
import torch

from lightning_datastates.demo import PRESETS, make_model


class TokenData(L.LightningDataModule):
    """Random token blocks of ``seq_len + 1`` ids (inputs and next-token targets), the same for a given seed."""

    def __init__(self, vocab: int = 512, seq_len: int = 32, batch_size: int = 4, batches: int = 64, seed: int = 0):
        super().__init__()
        self.vocab, self.seq_len, self.batch_size, self.batches, self.seed = vocab, seq_len, batch_size, batches, seed

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        tokens = torch.randint(self.vocab, (self.batches * self.batch_size, self.seq_len + 1), generator=generator)
        return torch.utils.data.DataLoader(tokens, batch_size=self.batch_size)


def small_gpt(fast: bool) -> tuple[L.LightningModule, TokenData]:
    """The model and data of the demo's ``fast`` (CI) or ``small`` preset."""
    shape = PRESETS["fast" if fast else "small"]
    data = TokenData(shape["vocab"], shape["seq_len"], shape["batch_size"])
    return make_model(shape), data
