"""offload"""
