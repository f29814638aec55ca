"""The TBO test harness: a small MoE-style model on the plugin's attention ops."""
