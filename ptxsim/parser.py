"""PTX text to executable structure: kernels, their parameters, registers, shared variables and instructions.

Only what the simulator needs is kept. Inline-asm scopes (``{ .reg .pred P1; LAB: ... }``) are flattened: a name
declared in a block (register or label) is renamed ``name@block`` so that two blocks reusing ``P1`` or ``DONE`` stay
apart (PTX ISA 11.2 "Scope": declarations in a block are visible only inside it).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional, Union

from .errors import Unsupported

# ---------------------------------------------------------------------------------------------------------------------
# operands


@dataclasses.dataclass(frozen=True)
class Reg:
    name: str


@dataclasses.dataclass(frozen=True)
class Imm:
    text: str  # the literal as written; its bits depend on the instruction's type (``imm_bits``)


@dataclasses.dataclass(frozen=True)
class Sym:
    name: str  # a shared, global or param variable, or a label used as a value


@dataclasses.dataclass(frozen=True)
class SReg:
    name: str  # %tid.x, %laneid, ...


@dataclasses.dataclass(frozen=True)
class Addr:
    base: Union[Reg, Sym, Imm, None]
    offset: int
    vec: Optional[tuple] = None  # [tmap, {c0, c1}]: the coordinate vector


@dataclasses.dataclass(frozen=True)
class Vec:
    items: tuple  # operands; None for the sink ``_``


@dataclasses.dataclass(frozen=True)
class Not:
    inner: object  # !%p


@dataclasses.dataclass(frozen=True)
class Pair:
    a: object  # d|p (setp, elect.sync)
    b: object


Operand = Union[Reg, Imm, Sym, SReg, Addr, Vec, Not, Pair, None]


@dataclasses.dataclass
class Instr:
    line: int  # 1-based line in the PTX text
    text: str
    opcode: str  # full dotted opcode
    words: tuple  # opcode split at dots (``::`` kept inside words)
    operands: tuple
    guard: Optional[Reg] = None
    guard_neg: bool = False


@dataclasses.dataclass
class Param:
    name: str
    size: int
    align: int
    offset: int = 0  # in the parameter buffer


@dataclasses.dataclass
class SharedVar:
    name: str
    size: int  # 0 for ``.extern`` (dynamic) arrays
    align: int
    extern: bool


@dataclasses.dataclass
class Function:
    name: str
    entry: bool
    params: list
    regs: dict  # name -> bits (1 for .pred)
    instrs: list
    labels: dict  # name -> instruction index
    reqntid: Optional[tuple] = None
    maxnreg: Optional[int] = None
    local_vars: dict = dataclasses.field(default_factory=dict)  # name -> (size, align)
    ret_params: list = dataclasses.field(default_factory=list)

    @property
    def param_bytes(self) -> int:
        end = 0
        for p in self.params:
            end = max(end, p.offset + p.size)
        return end


@dataclasses.dataclass
class Module:
    text: str
    functions: dict
    shared: dict  # module-scope shared variables, name -> SharedVar
    globals_: dict  # module-scope .global / .const variables: name -> (size, align, initial bytes)

    def entry(self, name: Optional[str] = None) -> Function:
        entries = [f for f in self.functions.values() if f.entry]
        if name is None:
            if len(entries) != 1:
                raise ValueError(f"{len(entries)} entries in the module: name one")
            return entries[0]
        return self.functions[name]


_TYPE_BITS = {"pred": 1, "b8": 8, "u8": 8, "s8": 8, "b16": 16, "u16": 16, "s16": 16, "f16": 16, "bf16": 16,
              "b32": 32, "u32": 32, "s32": 32, "f32": 32, "f16x2": 32, "bf16x2": 32, "b64": 64, "u64": 64, "s64": 64,
              "f64": 64, "b128": 128}

_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_REG_DECL = re.compile(r"^\.reg\s+(?:\.v(\d)\s+)?\.(\w+)\s+(.+)$", re.S)
_RANGE = re.compile(r"^(.*)<(\d+)>$")


def _split_top(text: str, sep: str = ",") -> list[str]:
    """Split at ``sep`` outside brackets and braces."""
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        if ch == sep and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    tail = "".join(cur).strip()
    if tail:
        out.append(tail)
    return out


class _Scanner:
    """Statements, labels and braces of a function body, with the line each starts on."""

    def __init__(self, text: str, base_line: int):
        self.text = text
        self.base_line = base_line

    def items(self):
        text, i, n = self.text, 0, len(self.text)
        line = self.base_line
        while i < n:
            ch = text[i]
            if ch == "\n":
                line += 1
                i += 1
                continue
            if ch.isspace():
                i += 1
                continue
            if ch == "{":
                yield ("open", line, None)
                i += 1
                continue
            if ch == "}":
                yield ("close", line, None)
                i += 1
                continue
            m = re.compile(r"[A-Za-z_$%][\w$@]*\s*:(?!:)").match(text, i)
            if m and not text[i] in "%":
                yield ("label", line, m.group(0).rstrip(":").strip())
                line += m.group(0).count("\n")
                i = m.end()
                continue
            j = text.find(";", i)
            if j < 0:
                raise Unsupported(f"PTX line {line}: statement without ';': {text[i:i + 80]!r}")
            stmt = text[i:j]
            yield ("stmt", line, stmt.strip())
            line += stmt.count("\n")
            i = j + 1


def _strip_comments(text: str) -> str:
    # keep line numbers: replace each comment by as many newlines as it held
    return _COMMENT.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def parse(text: str) -> Module:
    src = _strip_comments(text)
    functions: dict = {}
    shared: dict = {}
    globals_: dict = {}
    n = len(src)
    header = re.compile(r"(\.visible\s+|\.weak\s+|\.extern\s+)?\.(entry|func)\s+(\([^)]*\)\s*)?([\w$]+)\s*\(", re.S)
    pos = 0
    while True:
        m = header.search(src, pos)
        # module-scope declarations between pos and the next function
        chunk = src[pos:m.start() if m else n]
        _module_decls(chunk, shared, globals_)
        if not m:
            break
        entry = m.group(2) == "entry"
        name = m.group(4)
        ret_params = _params(m.group(3)[1:-1].strip().rstrip(")")) if m.group(3) else []
        # parameter list up to the matching ')'
        depth, j = 1, m.end()
        while depth:
            if src[j] == "(":
                depth += 1
            elif src[j] == ")":
                depth -= 1
            j += 1
        params = _params(src[m.end():j - 1])
        # performance directives, then the body (or ';' for a declaration)
        k = j
        while k < n and src[k] not in "{;":
            k += 1
        directives = src[j:k]
        if k >= n or src[k] == ";":
            pos = k + 1
            continue
        depth, b = 1, k + 1
        while depth:
            if src[b] == "{":
                depth += 1
            elif src[b] == "}":
                depth -= 1
            b += 1
        body = src[k + 1:b - 1]
        base_line = src.count("\n", 0, k + 1) + 1
        fn = _function(name, entry, params, body, base_line)
        fn.ret_params = ret_params
        r = re.search(r"\.reqntid\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?", directives)
        if r:
            fn.reqntid = tuple(int(x or 1) for x in r.groups())
        r = re.search(r"\.maxnreg\s+(\d+)", directives)
        if r:
            fn.maxnreg = int(r.group(1))
        functions[name] = fn
        pos = b
    return Module(text, functions, shared, globals_)


def _module_decls(chunk: str, shared: dict, globals_: dict) -> None:
    for stmt in chunk.split(";"):
        s = " ".join(stmt.split())
        # module directives (.version, .target, .address_size) end without ';': keep the declaration only
        k = min([i for i in (s.find(".extern"), s.find(".visible"), s.find(".weak"), s.find(".shared"),
                             s.find(".global"), s.find(".const")) if i >= 0] or [0])
        s = s[k:]
        m = re.match(r"^(?:\.extern\s+|\.visible\s+|\.weak\s+)*\.shared\s+(?:\.align\s+(\d+)\s+)?\.(\w+)\s+([\w$]+)"
                     r"\s*(?:\[(\d*)\])?", s)
        if m:
            align = int(m.group(1) or 1)
            bits = _TYPE_BITS.get(m.group(2), 8)
            count = m.group(4)
            extern = s.startswith(".extern") or count == ""
            size = 0 if extern else (bits // 8) * int(count or 1)
            shared[m.group(3)] = SharedVar(m.group(3), size, align, extern)
            continue
        m = re.match(r"^(?:\.visible\s+|\.weak\s+)*\.(global|const)\s+(?:\.align\s+(\d+)\s+)?\.(\w+)\s+([\w$]+)"
                     r"\s*(?:\[(\d*)\])?\s*(?:=\s*\{(.*)\})?", s)
        if m:
            bits = _TYPE_BITS.get(m.group(3), 8)
            count = int(m.group(5) or 1)
            init = bytes()
            if m.group(6):
                vals = [int(v, 0) for v in m.group(6).split(",")]
                init = b"".join(v.to_bytes(bits // 8, "little", signed=v < 0) for v in vals)
            globals_[m.group(4)] = ((bits // 8) * count, int(m.group(2) or 1), init)


def _params(text: str) -> list:
    params, offset = [], 0
    for p in _split_top(text):
        s = " ".join(p.split())
        if not s:
            continue
        m = re.match(r"^\.param\s+(?:\.align\s+(\d+)\s+)?\.(\w+)\s+([\w$]+)\s*(?:\[(\d+)\])?$", s)
        if not m:
            # pointer params: .param .u64 .ptr .global .align 16 name
            m2 = re.match(r"^\.param\s+\.(\w+)\s+(?:\.ptr\s+)?(?:\.\w+\s+)*(?:\.align\s+\d+\s+)?([\w$]+)$", s)
            if not m2:
                raise Unsupported(f"parameter declaration {s!r}")
            bits = _TYPE_BITS[m2.group(1)]
            size, align, name = bits // 8, bits // 8, m2.group(2)
        else:
            bits = _TYPE_BITS[m.group(2)]
            elem = max(bits // 8, 1)
            size = elem * int(m.group(4) or 1)
            align = int(m.group(1) or elem)
            name = m.group(3)
        offset = (offset + align - 1) // align * align
        params.append(Param(name, size, align, offset))
        offset += size
    return params


def _function(name: str, entry: bool, params: list, body: str, base_line: int) -> Function:
    # pass 1: statements with their block path; declarations per block
    items = list(_Scanner(body, base_line).items())
    block_stack = [0]
    next_block = 1
    decl: dict[int, set] = {0: set()}  # block -> names declared (regs and labels)
    parent = {0: None}
    stmts = []  # (kind, line, text, block)
    for kind, line, text in items:
        if kind == "open":
            parent[next_block] = block_stack[-1]
            decl[next_block] = set()
            block_stack.append(next_block)
            next_block += 1
        elif kind == "close":
            block_stack.pop()
        else:
            blk = block_stack[-1]
            if kind == "label":
                decl[blk].add(text)
            elif text.startswith(".reg"):
                for nm in _reg_names(text):
                    decl[blk].add(nm)
                    decl[blk].update(f"{nm}.{c}" for c in _vec_comps(text))
            stmts.append((kind, line, text, blk))

    def resolve(nm: str, blk: int) -> str:
        b = blk
        while b is not None:
            if nm in decl[b]:
                return nm if b == 0 else f"{nm}@{b}"
            b = parent[b]
        return nm

    regs: dict = {}
    vec_regs: dict = {}
    instrs: list = []
    labels: dict = {}
    local_vars: dict = {}
    vec_regs: dict = {}  # vector register variable -> its element registers
    for kind, line, text, blk in stmts:
        if kind == "label":
            labels[resolve(text, blk)] = len(instrs)
            continue
        if text.startswith(".reg"):
            m = _REG_DECL.match(" ".join(text.split()))
            if not m:
                raise Unsupported(f"PTX line {line}: {text!r}")
            bits = _TYPE_BITS.get(m.group(2))
            if bits is None:
                raise Unsupported(f"PTX line {line}: register type .{m.group(2)}")
            for nm in _reg_names(text):
                comps = _vec_comps(text)
                if comps and "." in nm:
                    continue  # an element name _reg_names lists too (identifiers have no '.'): declared below
                if comps:  # PTX ISA 5.4.2 Vectors: one scalar register per element (.x .y .z .w)
                    for c in comps:
                        regs[resolve(f"{nm}.{c}", blk)] = bits
                    vec_regs[resolve(nm, blk)] = tuple(Reg(resolve(f"{nm}.{c}", blk)) for c in comps)
                else:
                    regs[resolve(nm, blk)] = bits
            continue
        if text.startswith(".local"):
            m = re.match(r"^\.local\s+(?:\.align\s+(\d+)\s+)?\.(\w+)\s+([\w$]+)\s*(?:\[(\d+)\])?", " ".join(text.split()))
            if not m:
                raise Unsupported(f"PTX line {line}: {text!r}")
            local_vars[m.group(3)] = ((_TYPE_BITS[m.group(2)] // 8) * int(m.group(4) or 1), int(m.group(1) or 1))
            continue
        if text.startswith(".pragma") or text.startswith(".loc") or text.startswith(".file"):
            continue
        if text.startswith(".shared") or text.startswith(".maxntid") or text.startswith(".reqntid"):
            raise Unsupported(f"PTX line {line}: declaration inside a function body: {text!r}")
        if text.startswith("."):
            continue  # other directives carry no semantics the simulator uses
        ins = _instr(text, line, lambda nm, b=blk: resolve(nm, b))
        if vec_regs and any(isinstance(o, Reg) and o.name in vec_regs for o in ins.operands):
            # a vector variable named whole is the brace list of its elements (PTX ISA 5.4.2 Vectors)
            ins = dataclasses.replace(ins, operands=tuple(
                Vec(vec_regs[o.name]) if isinstance(o, Reg) and o.name in vec_regs else o for o in ins.operands))
        instrs.append(ins)
    return Function(name, entry, params, regs, instrs, labels, local_vars=local_vars)


def _vec_comps(text: str) -> tuple:
    """Element suffixes of a ``.reg .v2/.v4`` declaration (PTX ISA 5.4.2 Vectors), () for a scalar one."""
    m = _REG_DECL.match(" ".join(text.split()))
    if not m or not m.group(1):
        return ()
    n = int(m.group(1))
    if n not in (2, 4):
        raise Unsupported(f"register vector .v{n}: {text!r}")
    return ("x", "y", "z", "w")[:n]


def _reg_names(text: str) -> list[str]:
    m = _REG_DECL.match(" ".join(text.split()))
    if not m:
        return []
    if m.group(1):  # .reg .v4 .s32 abcd: the vector and its elements abcd.x .. abcd.w (PTX ISA 5.4.2 "Vectors")
        names = []
        for part in m.group(3).split(","):
            part = part.strip()
            names.append(part)
            names.extend(f"{part}.{c}" for c in "xyzw"[:int(m.group(1))])
        return names
    names = []
    for part in m.group(3).split(","):
        part = part.strip()
        r = _RANGE.match(part)
        if r:
            names.extend(f"{r.group(1)}{k}" for k in range(int(r.group(2))))
        elif part:
            names.append(part)
    return names


_IDENT = re.compile(r"^[A-Za-z_$%][\w$.]*$")


def _operand(tok: str, resolve) -> Operand:
    tok = tok.strip()
    if tok == "_":
        return None
    if tok.startswith("!"):
        return Not(_operand(tok[1:], resolve))
    if tok.startswith("["):
        inner = tok[1:-1].strip()
        parts = _split_top(inner)
        vec = None
        if len(parts) == 2:  # [tmap, {coords}]
            vec = _operand(parts[1], resolve)
            inner = parts[0]
        base, off = _addr_expr(inner, resolve)
        return Addr(base, off, vec.items if isinstance(vec, Vec) else None)
    if tok.startswith("{"):
        return Vec(tuple(_operand(t, resolve) for t in _split_top(tok[1:-1])))
    if "|" in tok:
        a, b = tok.split("|")
        return Pair(_operand(a, resolve), _operand(b, resolve))
    if re.match(r"^[-+]?(0[xX][0-9a-fA-F]+|0[fFdD][0-9a-fA-F]+|\d+(\.\d*)?([eE][-+]?\d+)?|\.\d+)[uU]?$", tok):
        return Imm(tok)
    if tok.startswith("%") and (tok.split(".")[0] in _SREGS):
        return SReg(tok)
    if _IDENT.match(tok):
        return Reg(resolve(tok)) if True else None
    # expressions like sym+4 outside brackets (mov.u64 %rd, sym+4)
    base, off = _addr_expr(tok, resolve)
    return Addr(base, off)


_SREGS = {"%tid", "%ntid", "%laneid", "%warpid", "%nwarpid", "%ctaid", "%nctaid", "%smid", "%nsmid", "%gridid",
          "%clock", "%clock64", "%globaltimer", "%globaltimer_lo", "%globaltimer_hi", "%lanemask_eq", "%lanemask_le",
          "%lanemask_lt", "%lanemask_ge", "%lanemask_gt", "%cluster_ctarank", "%cluster_nctarank", "%cluster_ctaid",
          "%cluster_nctaid", "%clusterid", "%nclusterid", "%is_explicit_cluster", "%dynamic_smem_size",
          "%total_smem_size", "%aggr_smem_size", "%envreg0", "%reserved_smem_offset_begin",
          "%reserved_smem_offset_end", "%reserved_smem_offset_cap"}


def _addr_expr(text: str, resolve):
    text = text.replace(" ", "")
    m = re.match(r"^([A-Za-z_$%][\w$.@]*)?((?:[-+]+\d+|[-+]?0[xX][0-9a-fA-F]+)*)$", text)
    if not m:
        if re.match(r"^-?\d+$", text):
            return Imm(text), 0
        raise Unsupported(f"address expression {text!r}")
    base = None
    if m.group(1):
        nm = m.group(1)
        base = SReg(nm) if nm.split(".")[0] in _SREGS else Reg(resolve(nm))
    off = 0
    for sign, num in re.findall(r"([-+]+)(0[xX][0-9a-fA-F]+|\d+)", m.group(2) or ""):
        v = int(num, 0)
        off += -v if sign.count("-") % 2 else v
    return base, off


def _instr(text: str, line: int, resolve) -> Instr:
    s = " ".join(text.split())
    guard, neg = None, False
    if s.startswith("@"):
        g, s = s.split(" ", 1)
        g = g[1:]
        if g.startswith("!"):
            neg, g = True, g[1:]
        guard = Reg(resolve(g))
    parts = s.split(" ", 1)
    opcode = parts[0]
    ops = tuple(_operand(t, resolve) for t in _split_top(parts[1])) if len(parts) > 1 else ()
    words = tuple(opcode.split("."))
    return Instr(line, text, opcode, words, ops, guard, neg)
