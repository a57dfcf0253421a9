"""A serialized HloModuleProto holding one custom call, written by hand.

torch_xla's `stablehlo_custom_call` cannot say that a result aliases an operand, so a
cache write emitted through it gets a fresh result buffer and XLA copies the whole
cache around it, donation or not. torch_xla does run user-built HLO computations
(`_xla_op_computation_from_module_proto` + `_xla_user_computation`, inlined into the
graph by XLA), and a custom call inside one may carry `output_operand_aliasing`.
torch_xla ships no HLO protobuf classes, so this module writes the few messages
needed with the protobuf wire format (field numbers from xla/service/hlo.proto and
xla/xla_data.proto, stable since they are XLA's serialization format)."""

from __future__ import annotations

# xla.PrimitiveType
PRIMITIVE_TYPES = {"bool": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "uint8": 6,
                   "float16": 10, "float32": 11, "float64": 12, "bfloat16": 16,
                   "float8_e5m2": 19, "float8_e4m3fn": 20}
_TUPLE = 13
_TYPED_FFI = 4


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int64s are ten-byte two's complement varints
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _int(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(value) if value else b""


def _bytes(field: int, value) -> bytes:
    value = value.encode() if isinstance(value, str) else bytes(value)
    return _varint(field << 3 | 2) + _varint(len(value)) + value


def _packed(field: int, values) -> bytes:
    return _bytes(field, b"".join(_varint(v) for v in values)) if values else b""


def _array_shape(dtype: str, dims) -> bytes:
    """ShapeProto: element_type 2, dimensions 3, layout 5 (LayoutProto.minor_to_major 1)."""
    rank = len(dims)
    return (_int(2, PRIMITIVE_TYPES[dtype]) + _packed(3, dims)
            + _bytes(5, _packed(1, range(rank - 1, -1, -1))))


def _tuple_shape(shapes) -> bytes:
    return _int(2, _TUPLE) + b"".join(_bytes(4, s) for s in shapes)


def custom_call_module(name: str, target: str, params, operands, results, backend_config,
                       api_version: int = _TYPED_FFI, aliases=None) -> bytes:
    """HloModuleProto bytes of `(params...) -> custom-call(operands...)`.

    params: [(dtype, dims)] of the computation's parameters, in the order the caller
    passes tensors; operands: for each custom-call operand, the index of the parameter
    it reads; results: [(dtype, dims)] (a tuple result when there are several);
    aliases: {result index: operand index} that share a buffer."""
    n = len(params)
    shapes = [_array_shape(d, dims) for d, dims in params]
    result = (_array_shape(*results[0]) if len(results) == 1
              else _tuple_shape(_array_shape(d, dims) for d, dims in results))
    # XlaBuilder expects HLO names of the form "<name>.<id>".
    instructions = [
        _bytes(1, f"p{i}.{i + 1}") + _bytes(2, "parameter") + _bytes(3, shapes[i]) + _int(9, i)
        + _int(35, i + 1) for i in range(n)]
    call_id = n + 1
    aliasing = b"".join(
        _bytes(74, (_packed(1, [out]) if len(results) > 1 else b"") + _int(2, operand))
        for out, operand in sorted((aliases or {}).items()))
    instructions.append(
        _bytes(1, f"custom-call.{call_id}") + _bytes(2, "custom-call") + _bytes(3, result)
        + _bytes(28, target) + _int(35, call_id) + _packed(36, [operands[j] + 1 for j in
                                                               range(len(operands))])
        + _bytes(43, backend_config) + aliasing + _int(77, api_version))
    program_shape = (b"".join(_bytes(1, s) for s in shapes) + _bytes(2, result)
                     + b"".join(_bytes(3, f"p{i}") for i in range(n)))
    computation_id = n + 2
    computation_name = f"{name}.{computation_id}"
    computation = (_bytes(1, computation_name) + b"".join(_bytes(2, i) for i in instructions)
                   + _bytes(4, program_shape) + _int(5, computation_id) + _int(6, call_id))
    return (_bytes(1, computation_name) + _bytes(2, computation_name) + _bytes(3, computation)
            + _bytes(4, program_shape) + _int(5, computation_id)
            + _int(6, computation_id))
