//! MATLAB MAT-files, level 5 (what `save -v6` and `save -v7` write, and what SVHN ships).
//!
//! Format (MathWorks, "MAT-File Format"): a 128-byte header (116 bytes of text, 8 bytes of
//! subsystem offset, a 16-bit version 0x0100 and the endian indicator `IM` or `MI`), then data
//! elements. Each element has an 8-byte tag (type, byte count) and its bytes padded to a multiple
//! of 8; a tag whose upper 16 bits are not zero is the small format, where the type and a count
//! of at most 4 share the first word and the data sits in the second. A variable is an
//! `miMATRIX` element, or an `miCOMPRESSED` element (a zlib stream, not padded) holding one.
//! An `miMATRIX` holds sub-elements: array flags (class, complex bit), dimensions, name, real
//! part (stored in any numeric type: MATLAB keeps a double array of small integers as bytes),
//! then the imaginary part of a complex array.
//!
//! Why not the `matfile` crate (0.5): it does read `miCOMPRESSED` elements, but it reads the
//! whole file into memory, keeps the decompressed copy and a parsed copy of every variable (about
//! three times the 225 MB of SVHN's training images), reports every problem as "An error occurred
//! while parsing the file", and prints to stdout from library code. This reader lists the
//! variables by reading only their headers, reads one variable at a time, says what is wrong and
//! where, and decompresses with flate2, which the crate already uses.

use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::Path;

use flate2::read::ZlibDecoder;

use crate::error::{Error, Result, WithPath};

pub const HEADER_BYTES: u64 = 128;

/// Data element types (MAT-File Format, table 1-1).
mod mi {
    pub const INT8: u32 = 1;
    pub const UINT8: u32 = 2;
    pub const INT16: u32 = 3;
    pub const UINT16: u32 = 4;
    pub const INT32: u32 = 5;
    pub const UINT32: u32 = 6;
    pub const SINGLE: u32 = 7;
    pub const DOUBLE: u32 = 9;
    pub const INT64: u32 = 12;
    pub const UINT64: u32 = 13;
    pub const MATRIX: u32 = 14;
    pub const COMPRESSED: u32 = 15;
    pub const UTF8: u32 = 16;
}

/// Bytes per value of a numeric data type, None for the others.
fn numeric_size(data_type: u32) -> Option<usize> {
    match data_type {
        mi::INT8 | mi::UINT8 => Some(1),
        mi::INT16 | mi::UINT16 => Some(2),
        mi::INT32 | mi::UINT32 | mi::SINGLE => Some(4),
        mi::DOUBLE | mi::INT64 | mi::UINT64 => Some(8),
        _ => None,
    }
}

fn type_name(data_type: u32) -> String {
    let name = match data_type {
        mi::INT8 => "miINT8",
        mi::UINT8 => "miUINT8",
        mi::INT16 => "miINT16",
        mi::UINT16 => "miUINT16",
        mi::INT32 => "miINT32",
        mi::UINT32 => "miUINT32",
        mi::SINGLE => "miSINGLE",
        mi::DOUBLE => "miDOUBLE",
        mi::INT64 => "miINT64",
        mi::UINT64 => "miUINT64",
        mi::MATRIX => "miMATRIX",
        mi::COMPRESSED => "miCOMPRESSED",
        mi::UTF8 => "miUTF8",
        17 => "miUTF16",
        18 => "miUTF32",
        _ => return format!("unknown type {data_type}"),
    };
    name.to_string()
}

/// Array classes (MAT-File Format, table 1-3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    Cell,
    Struct,
    Object,
    Char,
    Sparse,
    Double,
    Single,
    Int8,
    UInt8,
    Int16,
    UInt16,
    Int32,
    UInt32,
    Int64,
    UInt64,
    /// Function handles, opaque objects (strings, tables) and codes this reader does not know.
    Other(u8),
}

impl Class {
    fn from_code(code: u8) -> Class {
        const KNOWN: [Class; 15] = [
            Class::Cell, Class::Struct, Class::Object, Class::Char, Class::Sparse, Class::Double, Class::Single,
            Class::Int8, Class::UInt8, Class::Int16, Class::UInt16, Class::Int32, Class::UInt32, Class::Int64, Class::UInt64,
        ];
        match code {
            1..=15 => KNOWN[code as usize - 1],
            _ => Class::Other(code),
        }
    }

    pub fn name(self) -> String {
        match self {
            Class::Cell => "cell".into(),
            Class::Struct => "struct".into(),
            Class::Object => "object".into(),
            Class::Char => "char".into(),
            Class::Sparse => "sparse".into(),
            Class::Double => "double".into(),
            Class::Single => "single".into(),
            Class::Int8 => "int8".into(),
            Class::UInt8 => "uint8".into(),
            Class::Int16 => "int16".into(),
            Class::UInt16 => "uint16".into(),
            Class::Int32 => "int32".into(),
            Class::UInt32 => "uint32".into(),
            Class::Int64 => "int64".into(),
            Class::UInt64 => "uint64".into(),
            Class::Other(code) => format!("class {code}"),
        }
    }

    pub fn is_numeric(self) -> bool {
        matches!(
            self,
            Class::Double | Class::Single | Class::Int8 | Class::UInt8 | Class::Int16 | Class::UInt16
                | Class::Int32 | Class::UInt32 | Class::Int64 | Class::UInt64
        )
    }
}

/// One variable, as listed from its header.
#[derive(Clone, Debug, PartialEq)]
pub struct Variable {
    pub name: String,
    pub class: Class,
    /// MATLAB dimensions (column-major: the first varies fastest).
    pub dims: Vec<usize>,
    pub complex: bool,
    /// Offset of its top-level data element's tag in the file.
    offset: u64,
    /// Bytes of that element after its tag.
    len: u64,
    compressed: bool,
}

impl Variable {
    /// Values it holds (None when the product overflows).
    pub fn numel(&self) -> Option<usize> {
        self.dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
    }
}

/// The real part of a numeric variable, in the type it was stored in.
#[derive(Clone, Debug, PartialEq)]
pub struct Numeric {
    pub dims: Vec<usize>,
    /// The element type of the stored values (an `mi` code).
    stored: u32,
    bytes: Vec<u8>,
    big_endian: bool,
}

impl Numeric {
    /// The values as bytes, when they were stored as unsigned bytes (as a uint8 array always is).
    pub fn into_u8(self) -> std::result::Result<Vec<u8>, String> {
        if self.stored == mi::UINT8 {
            Ok(self.bytes)
        } else {
            Err(format!("values stored as {}, expected miUINT8", type_name(self.stored)))
        }
    }

    /// The values as f64 (exact for every stored type but 64-bit integers beyond 2^53).
    pub fn to_f64(&self) -> Vec<f64> {
        let size = numeric_size(self.stored).expect("checked when read");
        let be = self.big_endian;
        self.bytes
            .chunks_exact(size)
            .map(|b| match self.stored {
                mi::INT8 => b[0] as i8 as f64,
                mi::UINT8 => b[0] as f64,
                mi::INT16 => {
                    let a = [b[0], b[1]];
                    (if be { i16::from_be_bytes(a) } else { i16::from_le_bytes(a) }) as f64
                }
                mi::UINT16 => {
                    let a = [b[0], b[1]];
                    (if be { u16::from_be_bytes(a) } else { u16::from_le_bytes(a) }) as f64
                }
                mi::INT32 => {
                    let a = b.try_into().unwrap();
                    (if be { i32::from_be_bytes(a) } else { i32::from_le_bytes(a) }) as f64
                }
                mi::UINT32 => {
                    let a = b.try_into().unwrap();
                    (if be { u32::from_be_bytes(a) } else { u32::from_le_bytes(a) }) as f64
                }
                mi::SINGLE => {
                    let a = b.try_into().unwrap();
                    (if be { f32::from_be_bytes(a) } else { f32::from_le_bytes(a) }) as f64
                }
                mi::DOUBLE => {
                    let a = b.try_into().unwrap();
                    if be { f64::from_be_bytes(a) } else { f64::from_le_bytes(a) }
                }
                mi::INT64 => {
                    let a = b.try_into().unwrap();
                    (if be { i64::from_be_bytes(a) } else { i64::from_le_bytes(a) }) as f64
                }
                mi::UINT64 => {
                    let a = b.try_into().unwrap();
                    (if be { u64::from_be_bytes(a) } else { u64::from_le_bytes(a) }) as f64
                }
                _ => unreachable!("numeric_size accepted the type"),
            })
            .collect()
    }
}

/// A data element's tag.
#[derive(Clone, Copy, Debug)]
struct Tag {
    data_type: u32,
    len: u32,
    /// The data of a small-format element (at most 4 bytes, in the tag itself).
    small: Option<[u8; 4]>,
}

/// Reads data elements from a stream in the file's byte order.
struct Elements<R> {
    r: R,
    big_endian: bool,
}

/// Bytes allocated at a time for an element's data: a damaged length then costs no more memory
/// than the data that is really there.
const READ_BLOCK: usize = 64 << 20;

fn io_reason(e: &std::io::Error, what: &str) -> String {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof => format!("{what} is cut short (truncated or damaged file)"),
        _ => format!("{what}: {e}"),
    }
}

impl<R: Read> Elements<R> {
    fn word(&self, b: [u8; 4]) -> u32 {
        if self.big_endian { u32::from_be_bytes(b) } else { u32::from_le_bytes(b) }
    }

    fn tag(&mut self, what: &str) -> std::result::Result<Tag, String> {
        let mut b = [0u8; 8];
        self.r.read_exact(&mut b).map_err(|e| io_reason(&e, &format!("the tag of {what}")))?;
        let first = self.word(b[0..4].try_into().unwrap());
        if first >> 16 != 0 {
            let len = first >> 16;
            if len > 4 {
                return Err(format!("{what}: a small data element of {len} bytes (at most 4 fit)"));
            }
            Ok(Tag { data_type: first & 0xffff, len, small: Some(b[4..8].try_into().unwrap()) })
        } else {
            Ok(Tag { data_type: first, len: self.word(b[4..8].try_into().unwrap()), small: None })
        }
    }

    /// Reads an element's data and the padding after it.
    fn data(&mut self, tag: &Tag, what: &str) -> std::result::Result<Vec<u8>, String> {
        if let Some(small) = tag.small {
            return Ok(small[..tag.len as usize].to_vec());
        }
        let bytes = self.bytes(tag.len as usize, what)?;
        self.skip(padding(tag.len as u64), what)?;
        Ok(bytes)
    }

    fn bytes(&mut self, n: usize, what: &str) -> std::result::Result<Vec<u8>, String> {
        let mut buf: Vec<u8> = Vec::new();
        while buf.len() < n {
            let start = buf.len();
            let step = (n - start).min(READ_BLOCK);
            buf.reserve_exact(step);
            buf.resize(start + step, 0);
            self.r.read_exact(&mut buf[start..]).map_err(|e| io_reason(&e, what))?;
        }
        Ok(buf)
    }

    fn skip(&mut self, n: u64, what: &str) -> std::result::Result<(), String> {
        let copied = std::io::copy(&mut (&mut self.r).take(n), &mut std::io::sink()).map_err(|e| io_reason(&e, what))?;
        if copied < n {
            return Err(format!("{what} is cut short (truncated or damaged file)"));
        }
        Ok(())
    }

    /// The sub-elements that start every array: flags, dimensions and name. `what` names the
    /// element for messages.
    fn array_header(&mut self, what: &str) -> std::result::Result<(Class, bool, Vec<usize>, String), String> {
        let flags_tag = self.tag(&format!("{what}: array flags"))?;
        if flags_tag.data_type != mi::UINT32 || flags_tag.len != 8 {
            return Err(format!(
                "{what}: array flags are {} of {} bytes, expected miUINT32 of 8 bytes",
                type_name(flags_tag.data_type),
                flags_tag.len
            ));
        }
        let flags = self.data(&flags_tag, &format!("{what}: array flags"))?;
        let word = self.word(flags[0..4].try_into().unwrap());
        let class = Class::from_code((word & 0xff) as u8);
        let complex = word & 0x0800 != 0;

        // Opaque objects (class 17) have no dimensions sub-element; their name comes next.
        let dims = if class == Class::Other(17) {
            Vec::new()
        } else {
            let dims_tag = self.tag(&format!("{what}: dimensions"))?;
            if dims_tag.data_type != mi::INT32 || dims_tag.len % 4 != 0 || dims_tag.len < 8 {
                return Err(format!(
                    "{what}: dimensions are {} of {} bytes, expected miINT32 with at least two values",
                    type_name(dims_tag.data_type),
                    dims_tag.len
                ));
            }
            let raw = self.data(&dims_tag, &format!("{what}: dimensions"))?;
            raw.chunks_exact(4)
                .map(|b| {
                    let d = self.word(b.try_into().unwrap()) as i32;
                    usize::try_from(d).map_err(|_| format!("{what}: negative dimension {d}"))
                })
                .collect::<std::result::Result<Vec<usize>, String>>()?
        };

        let name_tag = self.tag(&format!("{what}: array name"))?;
        if !matches!(name_tag.data_type, mi::INT8 | mi::UTF8) {
            return Err(format!("{what}: array name is {}, expected miINT8 text", type_name(name_tag.data_type)));
        }
        let raw = self.data(&name_tag, &format!("{what}: array name"))?;
        let name = String::from_utf8(raw).map_err(|_| format!("{what}: the array name is not valid text"))?;
        Ok((class, complex, dims, name))
    }
}

/// Padding after `len` bytes of element data, to the next multiple of 8.
fn padding(len: u64) -> u64 {
    (8 - len % 8) % 8
}

/// A MAT-file open for reading variables. Generic over the stream so that tests can parse bytes.
pub struct MatReader<R> {
    inner: R,
    big_endian: bool,
    variables: Vec<Variable>,
}

impl<R: Read + Seek> MatReader<R> {
    /// Checks the header and lists the variables (reading their headers only).
    pub fn new(mut inner: R) -> std::result::Result<MatReader<R>, String> {
        let file_len = inner.seek(SeekFrom::End(0)).map_err(|e| e.to_string())?;
        inner.seek(SeekFrom::Start(0)).map_err(|e| e.to_string())?;
        if file_len < HEADER_BYTES {
            return Err(format!("{file_len} bytes: too short for a MAT-file (the header alone is {HEADER_BYTES} bytes)"));
        }
        let mut header = [0u8; HEADER_BYTES as usize];
        inner.read_exact(&mut header).map_err(|e| io_reason(&e, "the header"))?;
        let big_endian = match &header[126..128] {
            b"IM" => false,
            b"MI" => true,
            _ => {
                return Err(if header[..4].contains(&0) {
                    "not a MAT-file of level 5 (a MATLAB 4 file, or not a MAT-file at all)".into()
                } else {
                    "not a MAT-file (no endian indicator `IM` or `MI` at byte 126)".into()
                })
            }
        };
        let version = if big_endian { u16::from_be_bytes([header[124], header[125]]) } else { u16::from_le_bytes([header[124], header[125]]) };
        match version {
            0x0100 => {}
            0x0200 => {
                return Err("a MAT-file of version 7.3 (HDF5-based), which this reader does not read; \
                            save it again with `save -v7`"
                    .into())
            }
            v => return Err(format!("MAT-file version 0x{v:04x}, expected 0x0100 (level 5)")),
        }

        let mut variables = Vec::new();
        let mut offset = HEADER_BYTES;
        while offset < file_len {
            let what = format!("the data element at byte {offset}");
            if file_len - offset < 8 {
                return Err(format!("{what}: {} stray bytes at the end of the file (truncated?)", file_len - offset));
            }
            inner.seek(SeekFrom::Start(offset)).map_err(|e| e.to_string())?;
            let tag = Elements { r: &mut inner, big_endian }.tag(&what)?;
            if tag.small.is_some() {
                return Err(format!("{what}: a small data element where a variable was expected"));
            }
            let len = tag.len as u64;
            let available = file_len - offset - 8;
            if len > available {
                return Err(format!("{what} declares {len} bytes, the file holds {available} more (truncated)"));
            }
            let compressed = match tag.data_type {
                mi::MATRIX => false,
                mi::COMPRESSED => true,
                t => {
                    return Err(format!(
                        "{what} has type {}, expected miMATRIX or miCOMPRESSED (a variable)",
                        type_name(t)
                    ))
                }
            };
            if let Some((class, complex, dims, name)) = read_header(&mut inner, big_endian, compressed, len, &what)? {
                variables.push(Variable { name, class, dims, complex, offset, len, compressed });
            }
            // Uncompressed elements are padded to 8 bytes; compressed ones are not.
            let end = offset + 8 + len;
            offset = if compressed { end } else { (end + padding(end)).min(file_len) };
        }
        Ok(MatReader { inner, big_endian, variables })
    }

    #[cfg(test)]
    pub fn variables(&self) -> &[Variable] {
        &self.variables
    }

    /// The variable called `name`, or an error that lists what the file holds.
    pub fn find(&self, name: &str) -> std::result::Result<&Variable, String> {
        self.variables.iter().find(|v| v.name == name).ok_or_else(|| {
            let names: Vec<String> = self.variables.iter().map(|v| format!("`{}`", v.name)).collect();
            format!(
                "no variable `{name}` (the file holds {})",
                if names.is_empty() { "no variables".to_string() } else { names.join(", ") }
            )
        })
    }

    /// Reads the real part of the numeric variable `name`.
    pub fn read_numeric(&mut self, name: &str) -> std::result::Result<Numeric, String> {
        let var = self.find(name)?.clone();
        let what = format!("variable `{name}`");
        if !var.class.is_numeric() {
            return Err(format!("{what} is a {} array, expected a numeric array", var.class.name()));
        }
        if var.complex {
            return Err(format!("{what} is complex, expected real values"));
        }
        let numel = var.numel().ok_or_else(|| format!("{what}: dimensions {:?} overflow", var.dims))?;
        self.inner.seek(SeekFrom::Start(var.offset + 8)).map_err(|e| e.to_string())?;
        let body = (&mut self.inner).take(var.len);
        let big_endian = self.big_endian;
        if var.compressed {
            let mut elements = Elements { r: ZlibDecoder::new(body), big_endian };
            let tag = elements.tag(&what).map_err(|e| zlib_reason(e, &what))?;
            if tag.data_type != mi::MATRIX {
                return Err(format!("{what}: compressed data holds {}, expected miMATRIX", type_name(tag.data_type)));
            }
            let mut elements = Elements { r: elements.r.take(tag.len as u64), big_endian };
            read_real_part(&mut elements, numel, &var.dims, &what).map_err(|e| zlib_reason(e, &what))
        } else {
            read_real_part(&mut Elements { r: body, big_endian }, numel, &var.dims, &what)
        }
    }
}

/// zlib's own errors say "corrupt deflate stream" and the like; say where.
fn zlib_reason(reason: String, what: &str) -> String {
    if reason.starts_with(what) { reason } else { format!("{what}: {reason}") }
}

/// Reads the header of the variable whose element body starts at the reader's position.
/// None for an empty miMATRIX (no sub-elements: an empty cell's placeholder).
fn read_header<R: Read>(
    inner: &mut R,
    big_endian: bool,
    compressed: bool,
    len: u64,
    what: &str,
) -> std::result::Result<Option<(Class, bool, Vec<usize>, String)>, String> {
    let body = inner.take(len);
    if compressed {
        let mut elements = Elements { r: ZlibDecoder::new(body), big_endian };
        let tag = elements.tag(&format!("{what} (compressed)"))?;
        if tag.data_type != mi::MATRIX {
            return Err(format!("{what}: compressed data holds {}, expected miMATRIX", type_name(tag.data_type)));
        }
        if tag.len == 0 {
            return Ok(None);
        }
        let mut elements = Elements { r: elements.r.take(tag.len as u64), big_endian };
        elements.array_header(what).map(Some)
    } else {
        if len == 0 {
            return Ok(None);
        }
        Elements { r: body, big_endian }.array_header(what).map(Some)
    }
}

fn read_real_part<R: Read>(elements: &mut Elements<R>, numel: usize, dims: &[usize], what: &str) -> std::result::Result<Numeric, String> {
    elements.array_header(what)?;
    let tag = elements.tag(&format!("{what}: real part"))?;
    let size = numeric_size(tag.data_type)
        .ok_or_else(|| format!("{what}: real part stored as {}, expected a numeric type", type_name(tag.data_type)))?;
    let expected = numel.checked_mul(size).filter(|&b| b <= u32::MAX as usize);
    if expected != Some(tag.len as usize) {
        return Err(format!(
            "{what}: real part holds {} bytes of {}, dimensions {dims:?} need {numel} values",
            tag.len,
            type_name(tag.data_type)
        ));
    }
    // The padding after the last sub-element is not read: nothing follows that this needs.
    let bytes = match tag.small {
        Some(small) => small[..tag.len as usize].to_vec(),
        None => elements.bytes(tag.len as usize, &format!("{what}: real part"))?,
    };
    Ok(Numeric { dims: dims.to_vec(), stored: tag.data_type, bytes, big_endian: elements.big_endian })
}

/// Opens a MAT-file and lists its variables.
pub fn open(path: &Path) -> Result<MatReader<BufReader<std::fs::File>>> {
    let file = std::fs::File::open(path).at(path)?;
    if file.metadata().at(path)?.is_dir() {
        return Err(Error::data(path, "is a directory, not a MAT-file"));
    }
    MatReader::new(BufReader::with_capacity(1 << 20, file)).map_err(|reason| Error::data(path, reason))
}

/// Writing MAT-files, for the tests: one miMATRIX per variable, optionally wrapped in
/// miCOMPRESSED, in little-endian order as MATLAB on x86 writes them.
#[cfg(test)]
pub mod write {
    use std::io::Write;

    pub const CLASS_DOUBLE: u8 = 6;
    pub const CLASS_UINT8: u8 = 9;

    /// A variable to write: name, class code, dimensions, data type code and raw little-endian
    /// values of the real part.
    pub struct Var<'a> {
        pub name: &'a str,
        pub class: u8,
        pub dims: &'a [usize],
        pub data_type: u32,
        pub data: &'a [u8],
    }

    fn element(out: &mut Vec<u8>, data_type: u32, data: &[u8]) {
        if data.len() <= 4 && data_type != super::mi::MATRIX {
            // Small format: count and type share the first word.
            out.extend_from_slice(&(((data.len() as u32) << 16) | data_type).to_le_bytes());
            let mut word = [0u8; 4];
            word[..data.len()].copy_from_slice(data);
            out.extend_from_slice(&word);
            return;
        }
        out.extend_from_slice(&data_type.to_le_bytes());
        out.extend_from_slice(&(data.len() as u32).to_le_bytes());
        out.extend_from_slice(data);
        out.resize(out.len() + super::padding(data.len() as u64) as usize, 0);
    }

    /// The miMATRIX element of one variable.
    pub fn matrix(var: &Var) -> Vec<u8> {
        let mut body = Vec::new();
        let mut flags = Vec::new();
        flags.extend_from_slice(&(var.class as u32).to_le_bytes());
        flags.extend_from_slice(&0u32.to_le_bytes());
        element(&mut body, super::mi::UINT32, &flags);
        let dims: Vec<u8> = var.dims.iter().flat_map(|&d| (d as i32).to_le_bytes()).collect();
        element(&mut body, super::mi::INT32, &dims);
        element(&mut body, super::mi::INT8, var.name.as_bytes());
        element(&mut body, var.data_type, var.data);
        let mut out = Vec::new();
        element(&mut out, super::mi::MATRIX, &body);
        out
    }

    /// A whole file.
    pub fn file(vars: &[Var], compressed: bool) -> Vec<u8> {
        let mut out = Vec::new();
        let mut text = b"MATLAB 5.0 MAT-file, Platform: GLNXA64, Created on: hpc-train tests".to_vec();
        text.resize(116, b' ');
        out.extend_from_slice(&text);
        out.extend_from_slice(&[0u8; 8]);
        out.extend_from_slice(&0x0100u16.to_le_bytes());
        out.extend_from_slice(b"IM");
        for var in vars {
            let m = matrix(var);
            if compressed {
                let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
                z.write_all(&m).expect("writing to memory");
                let z = z.finish().expect("writing to memory");
                out.extend_from_slice(&super::mi::COMPRESSED.to_le_bytes());
                out.extend_from_slice(&(z.len() as u32).to_le_bytes());
                out.extend_from_slice(&z);
            } else {
                out.extend_from_slice(&m);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::write::{Var, CLASS_DOUBLE, CLASS_UINT8};
    use super::*;
    use std::io::Cursor;

    fn sample(compressed: bool) -> Vec<u8> {
        let pixels: Vec<u8> = (0..2 * 3 * 2 * 2).map(|i| i as u8 * 3).collect();
        let labels: Vec<u8> = [10.0f64, 3.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        write::file(
            &[
                Var { name: "X", class: CLASS_UINT8, dims: &[2, 3, 2, 2], data_type: mi::UINT8, data: &pixels },
                Var { name: "y", class: CLASS_DOUBLE, dims: &[2, 1], data_type: mi::DOUBLE, data: &labels },
            ],
            compressed,
        )
    }

    #[test]
    fn reads_what_was_written_compressed_or_not() {
        for compressed in [false, true] {
            let mut r = MatReader::new(Cursor::new(sample(compressed))).unwrap();
            let names: Vec<&str> = r.variables().iter().map(|v| v.name.as_str()).collect();
            assert_eq!(names, ["X", "y"]);
            assert_eq!(r.find("X").unwrap().dims, vec![2, 3, 2, 2]);
            assert_eq!(r.find("X").unwrap().class, Class::UInt8);
            let x = r.read_numeric("X").unwrap().into_u8().unwrap();
            assert_eq!(x, (0..24).map(|i| i as u8 * 3).collect::<Vec<u8>>());
            assert_eq!(r.read_numeric("y").unwrap().to_f64(), vec![10.0, 3.0]);
            assert!(r.find("Z").unwrap_err().contains("`X`, `y`"));
        }
    }

    #[test]
    fn doubles_stored_as_small_integers_and_big_endian_files() {
        // MATLAB stores a double array of small integers as miUINT8; a 1-value array fits a
        // small element.
        let file = write::file(&[Var { name: "y", class: CLASS_DOUBLE, dims: &[1, 1], data_type: mi::UINT8, data: &[7] }], false);
        let mut r = MatReader::new(Cursor::new(file)).unwrap();
        assert_eq!(r.read_numeric("y").unwrap().to_f64(), vec![7.0]);

        // The same small file in big-endian order, written by hand.
        let mut be = Vec::new();
        let mut text = b"MATLAB 5.0 MAT-file".to_vec();
        text.resize(116, b' ');
        be.extend_from_slice(&text);
        be.extend_from_slice(&[0; 8]);
        be.extend_from_slice(&0x0100u16.to_be_bytes());
        be.extend_from_slice(b"MI");
        let mut body = Vec::new();
        for w in [mi::UINT32, 8, CLASS_DOUBLE as u32, 0, mi::INT32, 8, 1, 2] {
            body.extend_from_slice(&w.to_be_bytes());
        }
        body.extend_from_slice(&((1u32 << 16) | mi::INT8).to_be_bytes());
        body.extend_from_slice(b"y\0\0\0");
        body.extend_from_slice(&mi::INT16.to_be_bytes());
        body.extend_from_slice(&4u32.to_be_bytes());
        body.extend_from_slice(&(-3i16).to_be_bytes());
        body.extend_from_slice(&500i16.to_be_bytes());
        body.extend_from_slice(&[0; 4]);
        be.extend_from_slice(&mi::MATRIX.to_be_bytes());
        be.extend_from_slice(&(body.len() as u32).to_be_bytes());
        be.extend_from_slice(&body);
        let mut r = MatReader::new(Cursor::new(be)).unwrap();
        assert_eq!(r.find("y").unwrap().dims, vec![1, 2]);
        assert_eq!(r.read_numeric("y").unwrap().to_f64(), vec![-3.0, 500.0]);
    }

    #[test]
    fn clear_errors_for_what_it_does_not_read() {
        let err = |bytes: Vec<u8>| MatReader::new(Cursor::new(bytes)).err().expect("an error");
        assert!(err(vec![0; 40]).contains("too short"));
        let mut v73 = sample(false);
        v73[124..126].copy_from_slice(&0x0200u16.to_le_bytes());
        assert!(err(v73).contains("7.3"));
        let mut v4 = sample(false);
        v4[..4].copy_from_slice(&[0, 0, 0, 0]);
        v4[126..128].copy_from_slice(b"??");
        assert!(err(v4).contains("MATLAB 4"));

        let chars = write::file(&[Var { name: "s", class: 4, dims: &[1, 2], data_type: 17, data: &[104, 0, 105, 0] }], true);
        let mut r = MatReader::new(Cursor::new(chars)).unwrap();
        assert!(r.read_numeric("s").unwrap_err().contains("char array"));

        // Dimensions that do not match the data.
        let bad = write::file(&[Var { name: "X", class: CLASS_UINT8, dims: &[3, 3], data_type: mi::UINT8, data: &[1; 8] }], false);
        let mut r = MatReader::new(Cursor::new(bad)).unwrap();
        assert!(r.read_numeric("X").unwrap_err().contains("need 9 values"));
        let doubles = write::file(&[Var { name: "X", class: CLASS_DOUBLE, dims: &[1, 1], data_type: mi::DOUBLE, data: &[0; 8] }], false);
        let mut r = MatReader::new(Cursor::new(doubles)).unwrap();
        assert!(r.read_numeric("X").unwrap().into_u8().unwrap_err().contains("miDOUBLE"));
    }

    /// Every cut, every flipped byte and pseudo-random garbage: an error or a value, never a panic
    /// (and a cut file is always an error).
    #[test]
    fn damaged_files_are_errors_not_panics() {
        for compressed in [false, true] {
            let good = sample(compressed);
            let read_all = |bytes: &[u8]| -> std::result::Result<(), String> {
                // What the SVHN importer needs: both variables, read in full.
                let mut r = MatReader::new(Cursor::new(bytes.to_vec()))?;
                r.read_numeric("X")?;
                r.read_numeric("y")?;
                Ok(())
            };
            read_all(&good).unwrap();
            for cut in 0..good.len() {
                assert!(read_all(&good[..cut]).is_err(), "compressed {compressed}: cut at {cut}");
            }
            for i in 0..good.len() {
                for flip in [0x01u8, 0x80, 0xff] {
                    let mut bad = good.clone();
                    bad[i] ^= flip;
                    let _ = read_all(&bad);
                }
            }
        }
        let mut x = 987_654_321u32;
        for len in (0..600).step_by(7) {
            let mut bytes = sample(false)[..128].to_vec();
            bytes.extend((0..len).map(|_| {
                x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                (x >> 16) as u8
            }));
            if let Ok(mut r) = MatReader::new(Cursor::new(bytes)) {
                let names: Vec<String> = r.variables().iter().map(|v| v.name.clone()).collect();
                for name in names {
                    let _ = r.read_numeric(&name);
                }
            }
        }
    }

    #[test]
    fn lengths_beyond_the_data_do_not_allocate_them() {
        // A real part that claims 3 GB in a tiny file: a clear error, without a 3 GB buffer.
        let mut file = write::file(&[Var { name: "X", class: CLASS_UINT8, dims: &[2, 2], data_type: mi::UINT8, data: &[1, 2, 3, 4, 5] }], false);
        // Patch the dimensions to 60000 x 50000 and the real part's length to match.
        let dims_at = 128 + 8 + 16 + 8;
        file[dims_at..dims_at + 4].copy_from_slice(&60_000i32.to_le_bytes());
        file[dims_at + 4..dims_at + 8].copy_from_slice(&50_000i32.to_le_bytes());
        let real_at = dims_at + 8 + 8;
        file[real_at + 4..real_at + 8].copy_from_slice(&3_000_000_000u32.to_le_bytes());
        let mut r = MatReader::new(Cursor::new(file)).unwrap();
        let err = r.read_numeric("X").unwrap_err();
        assert!(err.contains("cut short"), "{err}");
    }
}
