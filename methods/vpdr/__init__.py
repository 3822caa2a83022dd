"""VPDR's six prototype frameworks (FedProto, FedPCL, FPL, FedPLVM, FedTGP, MPFT) under IGPP / VPDR."""
