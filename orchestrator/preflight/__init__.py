"""Preflight: checks of a deployment before rollout (doctor), its environment read back
(deployment, serving) and written out (export_env), from profiles composed by compose."""
