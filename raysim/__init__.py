"""raysim: a Ray-based simulator of cross-device federated learning for foundation models under LDP."""

__version__ = "0.1.0"
