"""Wire format: bytes only (framing, messages, tensor codec, protocol ids). No torch, no trio, no libp2p."""
