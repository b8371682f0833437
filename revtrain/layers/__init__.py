"""Invertible layers beyond coupling blocks, each with M/C modes (see ``docs/layers.md``).

- :class:`InPlaceABN`: batch norm + leaky ReLU that rebuilds its input from its output
  (In-place ABN, Rota Bulò et al. 2018); :class:`BatchNormLeakyReLU` is its plain twin.
"""

from revtrain.layers.inplace_abn import ABNRecord, BatchNormLeakyReLU, InPlaceABN

__all__ = ["ABNRecord", "BatchNormLeakyReLU", "InPlaceABN"]
