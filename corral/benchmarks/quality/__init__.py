"""`corral bench quality`: does a constraint help or hurt task accuracy (JSONSchemaBench's "quality" axis)?"""
