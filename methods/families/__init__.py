"""Shared bases of the method families (prompt, heterogeneous zoo, homogeneous, prototype, VPDR)."""
