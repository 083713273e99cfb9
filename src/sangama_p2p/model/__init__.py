"""The runtime: torch only (spec, weights, layers, caches, sampling, tiny-model maker). No trio, no libp2p."""
