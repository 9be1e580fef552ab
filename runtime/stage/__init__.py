"""One pipeline stage: its model piece, transport, weights and emulated device."""
