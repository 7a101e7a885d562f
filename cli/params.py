"""click parameter types: conversion and its usage errors live here."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any, Optional

import click

from materialize.sizes import parse_size

if TYPE_CHECKING:
    import torch

# Spelled out here so that building the CLI does not import torch (see materialize.dtypes).
DTYPE_CHOICES = "auto, bf16, fp16, fp32, fp64, fp8_e4m3, fp8_e5m2"

_DEVICE = re.compile(r"^(cpu|cuda)(:\d+)?$")


class DtypeType(click.ParamType):
    name = "dtype"

    def get_metavar(self, param: click.Parameter, ctx: Optional[click.Context] = None) -> str:
        return "auto|bf16|fp16|fp32|..."

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> "Optional[torch.dtype]":
        from materialize.dtypes import parse_dtype

        if value is None or not isinstance(value, str):
            return value
        try:
            return parse_dtype(value)
        except ValueError:
            self.fail(f"unknown dtype {value!r}; choose one of: {DTYPE_CHOICES}", param, ctx)


class DeviceType(click.ParamType):
    name = "device"

    def get_metavar(self, param: click.Parameter, ctx: Optional[click.Context] = None) -> str:
        return "cpu|cuda|cuda:N"

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> str:
        text = str(value).strip().lower()
        if not _DEVICE.match(text) or text == "cpu:0":
            self.fail(f"{value!r} is not cpu, cuda or cuda:N", param, ctx)
        return text


class ModelArgType(click.ParamType):
    """``KEY=VALUE``; the value is a JSON literal where it parses, else a string."""

    name = "key=value"

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> tuple[str, Any]:
        if isinstance(value, tuple):
            return value
        key, sep, raw = str(value).partition("=")
        if not sep or not key.isidentifier():
            self.fail(f"{value!r} is not KEY=VALUE with KEY a Python identifier", param, ctx)
        try:
            return key, json.loads(raw)
        except json.JSONDecodeError:
            return key, raw


class RenameType(click.ParamType):
    """``PATTERN=REPLACEMENT``: a regex rename from checkpoint names to model names."""

    name = "pattern=replacement"

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> tuple[str, str]:
        if isinstance(value, tuple):
            return value
        pattern, sep, replacement = str(value).partition("=")
        if not sep or not pattern:
            self.fail(f"{value!r} is not PATTERN=REPLACEMENT", param, ctx)
        try:
            re.compile(pattern)
        except re.error as exc:
            self.fail(f"{pattern!r} is not a valid regular expression: {exc}", param, ctx)
        return pattern, replacement


class HeaderType(click.ParamType):
    """``NAME: VALUE``: a header sent to an http(s):// source's server."""

    name = "header"

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> tuple[str, str]:
        if isinstance(value, tuple):
            return value
        name, sep, text = str(value).partition(":")
        if not sep or not name.strip() or any(c in str(value) for c in "\r\n\0") or " " in name.strip():
            self.fail(f"{value!r} is not 'NAME: VALUE'", param, ctx)
        return name.strip(), text.strip()


class RegexType(click.ParamType):
    """A regular expression, checked as it is typed."""

    name = "regex"

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> str:
        try:
            re.compile(str(value))
        except re.error as exc:
            self.fail(f"{value!r} is not a valid regular expression: {exc}", param, ctx)
        if not value:
            self.fail("an empty expression finds every name: pass --ignore-unexpected for that", param, ctx)
        return str(value)


class SizeType(click.ParamType):
    name = "size"

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_size(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class DeviceMapType(click.ParamType):
    """A strategy name, or a JSON object of module name to device."""

    name = "device_map"
    STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> Any:
        if not isinstance(value, str) or value in self.STRATEGIES:
            return value
        try:
            mapping = json.loads(value)
        except json.JSONDecodeError:
            mapping = None
        if not isinstance(mapping, dict):
            self.fail(f"{value!r} is not one of {', '.join(self.STRATEGIES)} nor a JSON object of module to device", param, ctx)
        return mapping


class MaxMemoryType(click.ParamType):
    """``0=70GiB,cpu=100GiB,disk=1TB``: a budget per device for a computed device map."""

    name = "max_memory"

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> Any:
        if not isinstance(value, str):
            return value
        budget: dict[Any, int] = {}
        for part in filter(None, value.split(",")):
            device, sep, size = part.partition("=")
            if not sep:
                self.fail(f"{part!r} is not DEVICE=SIZE", param, ctx)
            try:
                budget[int(device) if device.strip().isdigit() else device.strip()] = parse_size(size)
            except ValueError as exc:
                self.fail(str(exc), param, ctx)
        return budget


DTYPE = DtypeType()
DEVICE_MAP = DeviceMapType()
MAX_MEMORY = MaxMemoryType()
SIZE = SizeType()
RENAME = RenameType()
REGEX = RegexType()
DEVICE = DeviceType()
MODEL_ARG = ModelArgType()
HEADER = HeaderType()
