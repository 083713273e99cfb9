"""Networking: trio + py-libp2p (identity, host, records, DHT, relay, hole punching). No torch."""
