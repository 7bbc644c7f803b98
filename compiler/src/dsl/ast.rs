//! The syntax tree of a DSL file. Every node carries its byte span in the source so
//! the lowering can point at it; nothing here is checked beyond the grammar.

use std::ops::Range;

/// A byte range in the source, `start..end`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// First byte.
    pub start: usize,
    /// One past the last byte.
    pub end: usize,
}

impl Span {
    /// The span `start..end`.
    pub fn new(start: usize, end: usize) -> Span {
        Span { start, end }
    }
    /// The smallest span covering both.
    pub fn to(self, other: Span) -> Span {
        Span::new(self.start.min(other.start), self.end.max(other.end))
    }
    /// As a range.
    pub fn range(self) -> Range<usize> {
        self.start..self.end
    }
}

impl From<pest::Span<'_>> for Span {
    fn from(s: pest::Span<'_>) -> Span {
        Span::new(s.start(), s.end())
    }
}

/// A name with where it is written.
#[derive(Clone, Debug, PartialEq)]
pub struct Ident {
    /// The name.
    pub name: String,
    /// Where.
    pub span: Span,
}

/// A whole file: its model and train blocks, in source order.
#[derive(Clone, Debug, PartialEq)]
pub struct File {
    /// `model` blocks (one is valid).
    pub models: Vec<Model>,
    /// `train` blocks (one is valid).
    pub trains: Vec<TrainBlock>,
}

/// `model name { statements }`.
#[derive(Clone, Debug, PartialEq)]
pub struct Model {
    /// The model's name.
    pub name: Ident,
    /// The statements in order.
    pub stmts: Vec<Stmt>,
    /// `model name` (for messages about the whole model).
    pub header: Span,
    /// The closing brace.
    pub close: Span,
}

/// A statement of the model block.
#[derive(Clone, Debug, PartialEq)]
pub enum Stmt {
    /// `input name: type`.
    Input {
        /// The input's name (a field of the data source).
        name: Ident,
        /// Its type; the first dimension must be `B`.
        ty: TypeExpr,
        /// The whole statement.
        span: Span,
    },
    /// `param name: type = init`.
    Param {
        /// The variable's name.
        name: Ident,
        /// Its type.
        ty: TypeExpr,
        /// Its initialiser.
        init: InitExpr,
        /// `shard(DIM)`: the dimension it splits along over a model axis, and the mark.
        shard: Option<(usize, Span)>,
        /// `frozen`: not trained.
        frozen: bool,
        /// The whole statement.
        span: Span,
    },
    /// `name = expr`.
    Let {
        /// The bound name.
        name: Ident,
        /// The value.
        value: Expr,
    },
    /// `pipeline_stage`: the statements after it start the next pipeline stage.
    StageMark {
        /// The marker.
        span: Span,
    },
    /// `minimize expr`.
    Minimize {
        /// The objective.
        expr: Expr,
        /// The whole statement.
        span: Span,
    },
}

/// `f32[B, 784]`.
#[derive(Clone, Debug, PartialEq)]
pub struct TypeExpr {
    /// The dtype as written.
    pub dtype: Ident,
    /// The dimensions as written.
    pub dims: Vec<Dim>,
    /// The whole type.
    pub span: Span,
}

/// One dimension of a written type.
#[derive(Clone, Debug, PartialEq)]
pub enum Dim {
    /// A number literal (checked to be a positive integer by the lowering).
    Number(String, Span),
    /// A name: only `B` is valid.
    Name(Ident),
}

/// `glorot` or `uniform(-0.05, 0.05)`.
#[derive(Clone, Debug, PartialEq)]
pub struct InitExpr {
    /// The initialiser's name.
    pub name: Ident,
    /// Its arguments, when written with parentheses.
    pub args: Option<Vec<Arg>>,
    /// The whole initialiser.
    pub span: Span,
}

/// `train { key = value ... }`.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainBlock {
    /// The entries in order.
    pub entries: Vec<TrainEntry>,
    /// The `train` keyword.
    pub keyword: Span,
    /// The closing brace.
    pub close: Span,
}

/// `key = value` in the train block.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainEntry {
    /// The key.
    pub key: Ident,
    /// The value.
    pub value: Expr,
}

/// An expression with its span.
#[derive(Clone, Debug, PartialEq)]
pub struct Expr {
    /// What it is.
    pub kind: ExprKind,
    /// Where it is.
    pub span: Span,
}

/// A binary operator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinOp {
    /// `+`
    Add,
    /// `-`
    Sub,
    /// `*`
    Mul,
    /// `/`
    Div,
    /// `@`
    MatMul,
}

impl BinOp {
    /// The operator as written.
    pub fn symbol(self) -> &'static str {
        match self {
            BinOp::Add => "+",
            BinOp::Sub => "-",
            BinOp::Mul => "*",
            BinOp::Div => "/",
            BinOp::MatMul => "@",
        }
    }
}

/// The kinds of expression.
#[derive(Clone, Debug, PartialEq)]
pub enum ExprKind {
    /// A number literal, as written (so integers can be checked exactly).
    Number(String),
    /// A name.
    Name(String),
    /// A string literal, without its quotes: a data file's path.
    Str(String),
    /// `lhs op rhs`.
    Binary {
        /// The operator.
        op: BinOp,
        /// The operator's span.
        op_span: Span,
        /// Left operand.
        lhs: Box<Expr>,
        /// Right operand.
        rhs: Box<Expr>,
    },
    /// `-x`.
    Neg(Box<Expr>),
    /// `name(args)`.
    Call {
        /// The op's name.
        name: Ident,
        /// The arguments.
        args: Vec<Arg>,
    },
    /// `[a, b, ...]`.
    List(Vec<Expr>),
}

/// One argument of a call: positional or `name = value`.
#[derive(Clone, Debug, PartialEq)]
pub struct Arg {
    /// The keyword, if given.
    pub name: Option<Ident>,
    /// The value.
    pub value: Expr,
    /// The whole argument.
    pub span: Span,
}
