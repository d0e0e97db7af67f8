"""Chains of real models: measured on a device, or derived on the meta device (issue 4)."""
