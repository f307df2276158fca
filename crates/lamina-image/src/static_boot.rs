//! Boot sets without a recorded start: the reads every start of an
//! executable makes, known from the image alone (`lamina convert
//! --boot-exec`, `lamina index --boot-exec`).
//!
//! For each executable, each shared object it needs (`DT_NEEDED`, searched
//! as the dynamic loader does) and each script interpreter (`#!`):
//! - the first page (ELF header, program headers; a script's `#!` line);
//! - the dynamic section and the writable segments: the loader relocates
//!   them and the program initialises them (python3: 297 of their 319 pages
//!   read by a start);
//! - the read-only segment before the code when it is at most
//!   [`MAX_SYMBOL_SEGMENT`]: symbol, string and relocation tables, which the
//!   loader reads throughout (libc: 35 of 38 pages). A larger one, like
//!   `node`'s 7.8 MB, is read in a few places only (312 of 1,903 pages);
//! - the pages of the entry point, `DT_INIT` and the constructors
//!   `DT_INIT_ARRAY` lists;
//! - all of the program interpreter (the dynamic loader: 44 of 53 pages).
//!
//! Plus `/etc/ld.so.cache` where a library is needed, and for a CPython interpreter the files its own
//! start reads before any script: the `encodings` modules it imports, the
//! `sitecustomize` module when there is one, and the C.UTF-8 locale it sets
//! (PEP 538). Which code and read-only data a start runs depends on what it
//! does; those pages still miss.
//!
//! Every path is resolved inside the image (symlinks included); what is
//! missing or malformed is skipped, since a boot set is only a hint.
//!
//! The walk reads the image's EROFS metadata and its files' bytes through
//! [`Units`]: a converted image's chunks ([`BuiltUnits`]) or an indexed
//! image's spans (`crate::tar_index`), every one checked against its digest
//! before a byte of it is parsed.

use std::collections::HashSet;
use std::io;

use lamina_format::erofs::{Chunk, Image, Inode, Kind};
use object::elf;
use object::read::elf::{Dyn, FileHeader, ProgramHeader};

use crate::boot::{ChunkRead, ChunkReader};
use crate::build::BuiltImage;

/// Where a walk finds the bytes of the image's files: the stored units
/// (chunks of a converted image, spans of a tar index) of blob `b`, which
/// is EROFS device `b + 1`.
pub trait Units {
    /// The unit of blob `blob` holding byte `offset` of its device: its
    /// number, the offset inside it and the unit's bytes from there on.
    fn unit_at(&self, blob: usize, offset: u64) -> Option<(usize, u64, u64)>;
    /// Unit `unit` of blob `blob`, uncompressed and checked against its
    /// digest.
    fn unit(&mut self, blob: usize, unit: usize) -> io::Result<&[u8]>;
}

/// A converted image's chunks, read back from its built blobs.
#[derive(Debug)]
pub struct BuiltUnits<'a> {
    image: &'a BuiltImage,
    reader: ChunkReader,
}

impl<'a> BuiltUnits<'a> {
    /// The chunks of `image`.
    pub fn new(image: &'a BuiltImage) -> Self {
        BuiltUnits {
            image,
            reader: ChunkReader::default(),
        }
    }
}

impl Units for BuiltUnits<'_> {
    fn unit_at(&self, blob: usize, offset: u64) -> Option<(usize, u64, u64)> {
        let (chunk, within) = self.image.chunk_at(blob, offset)?;
        let size = u64::from(self.image.blobs[blob].chunks[chunk].size.get());
        Some((chunk, within, size - within))
    }

    fn unit(&mut self, blob: usize, unit: usize) -> io::Result<&[u8]> {
        self.reader.chunk(self.image, blob, unit)
    }
}

/// The largest read-only segment before the code taken whole (see the
/// module doc).
pub const MAX_SYMBOL_SEGMENT: u64 = 512 << 10;
/// The most bytes a boot set known from the image takes (python3's is
/// 2.2 MB); a hostile image's claims stop here.
const MAX_TAKEN: u64 = 64 << 20;
/// The largest file (a dynamic loader, a cache, a module) taken whole.
const MAX_WHOLE_FILE: u64 = 1 << 20;
/// The bytes of an ELF file read for its headers.
const HEADER_BYTES: u64 = 64 << 10;
/// The largest dynamic section read.
const MAX_DYNAMIC: u64 = 64 << 10;
/// Shared objects followed per executable (a loop or a hostile image stops
/// here).
const MAX_OBJECTS: usize = 512;
/// Symlinks followed in one path, as the kernel's limit.
const MAX_SYMLINKS: usize = 40;
/// `#!` interpreters followed in a row (the kernel allows 4).
const MAX_SCRIPT_DEPTH: usize = 4;
/// Where a path names nothing else, as the loader's defaults.
const DEFAULT_LIBRARY_DIRS: &[&str] = &["/lib", "/usr/lib", "/lib64", "/usr/lib64"];
/// docker's PATH when the image sets none.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// A page.
const PAGE: u64 = 4096;
/// The ELF identification byte giving the class (32 or 64 bits).
const EI_CLASS: usize = 4;

/// How the executables are found: the image config's `Env` and
/// `WorkingDir`.
#[derive(Debug, Clone, Default)]
pub struct ExecEnv {
    /// `PATH` (docker's default when unset).
    pub path: Option<String>,
    /// `LD_LIBRARY_PATH`.
    pub library_path: Option<String>,
    /// The working directory, for relative executable paths.
    pub working_dir: Option<String>,
}

impl ExecEnv {
    /// From an image config (`{"config": {"Env": [...], "WorkingDir": ...}}`).
    pub fn from_config(config: &serde_json::Value) -> ExecEnv {
        let c = &config["config"];
        let var = |name: &str| {
            c["Env"].as_array()?.iter().find_map(|v| {
                let (k, v) = v.as_str()?.split_once('=')?;
                (k == name).then(|| v.to_string())
            })
        };
        ExecEnv {
            path: var("PATH"),
            library_path: var("LD_LIBRARY_PATH"),
            working_dir: c["WorkingDir"].as_str().map(str::to_string),
        }
    }
}

/// The command an image runs: `Entrypoint` then `Cmd`, docker's rule.
pub fn config_command(config: &serde_json::Value) -> Vec<String> {
    let strings = |v: &serde_json::Value| -> Vec<String> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    };
    let c = &config["config"];
    let mut argv = strings(&c["Entrypoint"]);
    argv.extend(strings(&c["Cmd"]));
    argv
}

/// The executables a command starts: its program, and for `env` the program
/// `env` runs.
pub fn command_executables(argv: &[String]) -> Vec<String> {
    let Some(first) = argv.first() else {
        return Vec::new();
    };
    let mut out = vec![first.clone()];
    if first.rsplit('/').next() == Some("env") {
        if let Some(next) = argv[1..]
            .iter()
            .find(|a| !a.starts_with('-') && !a.contains('='))
        {
            out.push(next.clone());
        }
    }
    out
}

/// Why no boot set could be made from the image.
#[derive(Debug, thiserror::Error)]
pub enum StaticBootError {
    /// A program named is not in the image (a typo would otherwise give
    /// an image without the boot set asked for).
    #[error("--boot-exec {0}: no such program in the image (searched {1})")]
    NotFound(String, String),
    /// The image's own metadata did not read back.
    #[error("reading the built metadata: {0}")]
    Metadata(String),
    /// A file's bytes could not be read or did not match their digest.
    #[error("reading the image's files for --boot-exec: {0}")]
    Read(io::Error),
}

/// The reads every start of `execs` makes (see the module doc), in the order
/// a start makes them, as chunk reads of `image`.
pub fn static_reads(
    image: &BuiltImage,
    execs: &[String],
    env: &ExecEnv,
) -> Result<Vec<ChunkRead>, StaticBootError> {
    static_unit_reads(&image.metadata, &mut BuiltUnits::new(image), execs, env)
}

/// [`static_reads`] of any image: its EROFS `metadata` and the units its
/// files are stored in. The reads name units (`ChunkRead::chunk`).
pub fn static_unit_reads(
    metadata: &[u8],
    units: &mut dyn Units,
    execs: &[String],
    env: &ExecEnv,
) -> Result<Vec<ChunkRead>, StaticBootError> {
    let erofs = Image::new(metadata).map_err(|e| StaticBootError::Metadata(e.to_string()))?;
    let mut walk = Walk {
        units,
        erofs,
        reads: Vec::new(),
        done: HashSet::new(),
        library_dirs: Vec::new(),
        taken: 0,
        failed: None,
    };
    walk.library_dirs = walk.ld_so_conf();
    for exec in execs {
        let Some(path) = walk.find_program(exec, env) else {
            let searched = match exec.contains('/') {
                true => env.working_dir.clone().unwrap_or_else(|| "/".into()),
                false => format!("PATH={}", env.path.as_deref().unwrap_or(DEFAULT_PATH)),
            };
            return Err(StaticBootError::NotFound(exec.clone(), searched));
        };
        walk.program(&path, env, 0);
    }
    match walk.failed {
        Some(e) => Err(StaticBootError::Read(e)),
        None => Ok(walk.reads),
    }
}

/// The state of one walk over an image.
struct Walk<'a, 'u> {
    /// Where the files' bytes are.
    units: &'u mut dyn Units,
    erofs: Image<'a>,
    reads: Vec<ChunkRead>,
    /// Files already taken (resolved paths).
    done: HashSet<Vec<u8>>,
    /// Directories of `/etc/ld.so.conf` (and what it includes).
    library_dirs: Vec<Vec<u8>>,
    /// Bytes taken so far (at most [`MAX_TAKEN`]).
    taken: u64,
    /// The first unit that could not be read: the walk goes on (what it
    /// reads is a hint), the set is refused at its end.
    failed: Option<io::Error>,
}

impl<'a> Walk<'a, '_> {
    /// Resolves `path` inside the image, following symlinks: the resolved
    /// path and its inode, when it is a regular file.
    fn resolve(&self, path: &[u8]) -> Option<(Vec<u8>, Inode<'a>)> {
        let mut pending: Vec<Vec<u8>> = components(path).rev().collect();
        let mut at: Vec<Vec<u8>> = Vec::new();
        let mut links = 0;
        let root = self.erofs.inode(self.erofs.root_nid()).ok()?;
        let mut inodes = vec![root];
        while let Some(name) = pending.pop() {
            if name == b".." {
                if at.pop().is_some() {
                    inodes.pop();
                }
                continue;
            }
            let dir = inodes.last()?;
            let entry = self.erofs.lookup(dir, &name).ok()??;
            let inode = self.erofs.inode(entry.nid).ok()?;
            if inode.kind() == Some(Kind::Symlink) {
                links += 1;
                if links > MAX_SYMLINKS {
                    return None;
                }
                let target = self.erofs.symlink_target(&inode).ok()?;
                if target.starts_with(b"/") {
                    at.clear();
                    inodes.truncate(1);
                }
                pending.extend(components(&target).rev());
                continue;
            }
            at.push(name);
            inodes.push(inode);
        }
        let inode = inodes.pop()?;
        (inode.kind() == Some(Kind::Regular)).then(|| (join(&at), inode))
    }

    /// `ld.so.conf`'s directories, includes followed one level deep.
    fn ld_so_conf(&mut self) -> Vec<Vec<u8>> {
        let mut dirs = Vec::new();
        let Some(text) = self.small_file(b"/etc/ld.so.conf") else {
            return dirs;
        };
        for line in conf_lines(&text) {
            match line.strip_prefix(b"include") {
                Some(pattern) => {
                    for path in self.glob_conf(pattern.trim_ascii()) {
                        if let Some(text) = self.small_file(&path) {
                            dirs.extend(conf_lines(&text).filter(|l| !l.starts_with(b"include")));
                        }
                    }
                }
                None => dirs.push(line),
            }
        }
        dirs
    }

    /// The files `DIR/*.conf` names (the only pattern `ld.so.conf` uses).
    fn glob_conf(&self, pattern: &[u8]) -> Vec<Vec<u8>> {
        match pattern.strip_suffix(b"/*.conf") {
            Some(dir) => self.paths_in(dir, |name| name.ends_with(b".conf")),
            None => Vec::new(),
        }
    }

    /// The paths of the entries of directory `dir` whose names `keep`
    /// takes, sorted.
    fn paths_in(&self, dir: &[u8], keep: impl Fn(&[u8]) -> bool) -> Vec<Vec<u8>> {
        let Some(inode) = self.resolve_dir(dir) else {
            return Vec::new();
        };
        let mut paths: Vec<Vec<u8>> = self
            .erofs
            .entries(&inode)
            .unwrap_or_default()
            .iter()
            .filter(|e| keep(e.name))
            .map(|e| [dir, b"/", e.name].concat())
            .collect();
        paths.sort();
        paths
    }

    fn resolve_dir(&self, path: &[u8]) -> Option<Inode<'a>> {
        let mut inode = self.erofs.inode(self.erofs.root_nid()).ok()?;
        for name in components(path) {
            let entry = self.erofs.lookup(&inode, &name).ok()??;
            inode = self.erofs.inode(entry.nid).ok()?;
        }
        (inode.kind() == Some(Kind::Directory)).then_some(inode)
    }

    /// The program a command names: a path (against the working
    /// directory), else the first match on `PATH`.
    fn find_program(&self, name: &str, env: &ExecEnv) -> Option<Vec<u8>> {
        if name.contains('/') {
            let base = env.working_dir.as_deref().unwrap_or("/");
            let path = if name.starts_with('/') {
                name.to_string()
            } else {
                format!("{base}/{name}")
            };
            return Some(self.resolve(path.as_bytes())?.0);
        }
        let path = env.path.as_deref().unwrap_or(DEFAULT_PATH);
        path.split(':')
            .filter(|d| d.starts_with('/'))
            .find_map(|d| self.resolve(format!("{d}/{name}").as_bytes()))
            .map(|(p, _)| p)
    }

    /// A program: an ELF file and what it needs, or a script and its
    /// interpreter.
    fn program(&mut self, path: &[u8], env: &ExecEnv, depth: usize) {
        let Some((path, inode)) = self.resolve(path) else {
            return;
        };
        let Ok(head) = self.read(&inode, 0, HEADER_BYTES) else {
            return;
        };
        if let Some(line) = head.strip_prefix(b"#!") {
            if depth >= MAX_SCRIPT_DEPTH || !self.done.insert(path.clone()) {
                return;
            }
            self.take(&inode, 0, PAGE);
            let line = line.split(|&b| b == b'\n').next().unwrap_or_default();
            let argv: Vec<String> = String::from_utf8_lossy(line)
                .split_ascii_whitespace()
                .map(str::to_string)
                .collect();
            for exec in command_executables(&argv) {
                if let Some(found) = self.find_program(&exec, env) {
                    self.program(&found, env, depth + 1);
                }
            }
            return;
        }
        let mut queue = vec![path];
        let mut objects = 0;
        while let Some(next) = queue.pop() {
            objects += 1;
            if objects > MAX_OBJECTS {
                break;
            }
            if let Some(needed) = self.elf_object(&next, env) {
                queue.extend(needed.into_iter().rev());
            }
        }
    }

    /// Takes an ELF object's start-up pages; returns the resolved paths of
    /// the objects it needs (`None` when taken already or not ELF).
    fn elf_object(&mut self, path: &[u8], env: &ExecEnv) -> Option<Vec<Vec<u8>>> {
        if !self.done.insert(path.to_vec()) {
            return None;
        }
        let (_, inode) = self.resolve(path)?;
        let head = self.read(&inode, 0, HEADER_BYTES).ok()?;
        let facts = match head.get(EI_CLASS) {
            Some(&elf::ELFCLASS64) => {
                self.elf_facts::<elf::FileHeader64<object::Endianness>>(&inode, &head)
            }
            Some(&elf::ELFCLASS32) => {
                self.elf_facts::<elf::FileHeader32<object::Endianness>>(&inode, &head)
            }
            _ => None,
        }?;
        if let Some(interp) = facts.interpreter {
            self.whole_file(&interp);
        }
        if !facts.needed.is_empty() {
            // Where the loader looks a library up first.
            self.whole_file(b"/etc/ld.so.cache");
        }
        if self.is_python(path) {
            self.python_start(path);
        }
        let dir = parent(path);
        let mut search: Vec<Vec<u8>> = Vec::new();
        // DT_RPATH before LD_LIBRARY_PATH, DT_RUNPATH after (ld.so(8)).
        if facts.runpath.is_empty() {
            search.extend(facts.rpath.iter().map(|p| origin(p, &dir)));
        }
        if let Some(lp) = &env.library_path {
            search.extend(
                lp.split(':')
                    .filter(|d| !d.is_empty())
                    .map(|d| d.as_bytes().to_vec()),
            );
        }
        search.extend(facts.runpath.iter().map(|p| origin(p, &dir)));
        search.extend(self.library_dirs.iter().cloned());
        search.extend(DEFAULT_LIBRARY_DIRS.iter().map(|d| d.as_bytes().to_vec()));
        let needed = facts
            .needed
            .iter()
            .filter_map(|name| {
                if name.contains(&b'/') {
                    return Some(self.resolve(name)?.0);
                }
                search
                    .iter()
                    .find_map(|d| self.resolve(&[d.as_slice(), b"/", name].concat()))
                    .map(|(p, _)| p)
            })
            .collect();
        Some(needed)
    }

    /// Takes the pages of an ELF file named in the module doc; returns what
    /// the rest of the walk needs from it.
    fn elf_facts<E: FileHeader<Endian = object::Endianness>>(
        &mut self,
        inode: &Inode<'a>,
        head: &[u8],
    ) -> Option<ElfFacts> {
        let header = E::parse(head).ok()?;
        let endian = header.endian().ok()?;
        let phdrs = header.program_headers(endian, head).ok()?;
        self.take(inode, 0, PAGE);
        let loads: Vec<Load> = phdrs
            .iter()
            .filter(|p| p.p_type(endian) == elf::PT_LOAD)
            .map(|p| Load {
                offset: p.p_offset(endian).into(),
                vaddr: p.p_vaddr(endian).into(),
                filesz: p.p_filesz(endian).into(),
                flags: p.p_flags(endian),
            })
            .collect();
        let mut facts = ElfFacts::default();
        let mut dynamic = None;
        for p in phdrs {
            let (offset, size): (u64, u64) = (p.p_offset(endian).into(), p.p_filesz(endian).into());
            match p.p_type(endian) {
                elf::PT_INTERP => {
                    let bytes = self.read(inode, offset, size.min(PAGE)).ok()?;
                    facts.interpreter = Some(bytes.split(|&b| b == 0).next()?.to_vec());
                }
                elf::PT_DYNAMIC => {
                    self.take(inode, offset, size);
                    dynamic = Some((offset, size.min(MAX_DYNAMIC)));
                }
                _ => {}
            }
        }
        for (n, load) in loads.iter().enumerate() {
            let writable = load.flags & elf::PF_W != 0;
            let symbols =
                n == 0 && load.flags & elf::PF_X == 0 && load.filesz <= MAX_SYMBOL_SEGMENT;
            if writable || symbols {
                self.take(inode, load.offset, load.filesz);
            }
        }
        let entry: u64 = header.e_entry(endian).into();
        self.take_vaddr(inode, &loads, entry);
        if let Some((offset, size)) = dynamic {
            let bytes = self.read(inode, offset, size).ok()?;
            let entries = object::pod::slice_from_all_bytes::<E::Dyn>(
                &bytes[..bytes.len() - bytes.len() % size_of::<E::Dyn>()],
            )
            .ok()?;
            self.dynamic::<E>(inode, &loads, endian, entries, &mut facts);
        }
        Some(facts)
    }

    /// Reads the dynamic section: what it needs, where to look, and the
    /// constructors' pages.
    fn dynamic<E: FileHeader<Endian = object::Endianness>>(
        &mut self,
        inode: &Inode<'a>,
        loads: &[Load],
        endian: object::Endianness,
        entries: &[E::Dyn],
        facts: &mut ElfFacts,
    ) {
        let value = |tag: u32| {
            entries
                .iter()
                .find(|d| d.d_tag(endian).into() == u64::from(tag))
                .map(|d| d.d_val(endian).into())
        };
        let strtab = value(elf::DT_STRTAB).and_then(|v| file_offset(loads, v));
        for d in entries {
            let tag: u64 = d.d_tag(endian).into();
            if tag == u64::from(elf::DT_NULL) {
                break;
            }
            let val: u64 = d.d_val(endian).into();
            let string = |walk: &mut Self| {
                let at = strtab?.checked_add(val)?;
                let bytes = walk.read(inode, at, PAGE).ok()?;
                Some(bytes.split(|&b| b == 0).next()?.to_vec())
            };
            match u32::try_from(tag).unwrap_or(0) {
                elf::DT_NEEDED => facts.needed.extend(string(self)),
                elf::DT_RPATH => facts
                    .rpath
                    .extend(string(self).map(split_paths).unwrap_or_default()),
                elf::DT_RUNPATH => facts
                    .runpath
                    .extend(string(self).map(split_paths).unwrap_or_default()),
                elf::DT_INIT => self.take_vaddr(inode, loads, val),
                _ => {}
            }
        }
        let (Some(array), Some(size)) = (value(elf::DT_INIT_ARRAY), value(elf::DT_INIT_ARRAYSZ))
        else {
            return;
        };
        let width = if size_of::<E::Word>() == 8 { 8 } else { 4 };
        let Some(at) = file_offset(loads, array) else {
            return;
        };
        let Ok(bytes) = self.read(inode, at, size.min(MAX_DYNAMIC)) else {
            return;
        };
        // A position-independent object's array holds zeros or addends
        // (relocated at load); a target outside its segments is skipped.
        for word in bytes.chunks_exact(width) {
            let target = match (width, endian) {
                (8, object::Endianness::Little) => {
                    u64::from_le_bytes(word.try_into().unwrap_or_default())
                }
                (8, object::Endianness::Big) => {
                    u64::from_be_bytes(word.try_into().unwrap_or_default())
                }
                (_, object::Endianness::Little) => {
                    u64::from(u32::from_le_bytes(word.try_into().unwrap_or_default()))
                }
                (_, object::Endianness::Big) => {
                    u64::from(u32::from_be_bytes(word.try_into().unwrap_or_default()))
                }
            };
            self.take_vaddr(inode, loads, target);
        }
    }

    /// Whether `path` is a CPython interpreter (`pythonX.Y`).
    fn is_python(&self, path: &[u8]) -> bool {
        python_version(path).is_some()
    }

    /// A CPython interpreter's own start-up files (module doc).
    fn python_start(&mut self, path: &[u8]) {
        let Some((major, minor)) = python_version(path) else {
            return;
        };
        let prefix = parent(&parent(path));
        let lib = [
            prefix.as_slice(),
            format!("/lib/python{major}.{minor}").as_bytes(),
        ]
        .concat();
        let tag = format!("cpython-{major}{minor}.pyc");
        for module in [
            "encodings/__init__",
            "encodings/aliases",
            "encodings/utf_8",
            "sitecustomize",
        ] {
            let (package, name) = module.rsplit_once('/').unwrap_or(("", module));
            let pyc = format!("/{package}/__pycache__/{name}.{tag}");
            self.whole_file(&[lib.as_slice(), pyc.replace("//", "/").as_bytes()].concat());
        }
        for path in self.paths_in(b"/usr/lib/locale/C.utf8", |name| name.starts_with(b"LC_")) {
            if let Some((_, inode)) = self.resolve(&path) {
                self.take(&inode, 0, PAGE);
            }
        }
    }

    /// Takes a whole file (at most [`MAX_WHOLE_FILE`]).
    fn whole_file(&mut self, path: &[u8]) {
        if let Some((resolved, inode)) = self.resolve(path) {
            if inode.size <= MAX_WHOLE_FILE && self.done.insert(resolved) {
                self.take(&inode, 0, inode.size);
            }
        }
    }

    /// A small file's bytes (a configuration file).
    fn small_file(&mut self, path: &[u8]) -> Option<Vec<u8>> {
        let (_, inode) = self.resolve(path)?;
        (inode.size <= PAGE * 16).then(|| self.read(&inode, 0, inode.size).ok())?
    }

    /// Takes the page holding virtual address `vaddr`.
    fn take_vaddr(&mut self, inode: &Inode<'a>, loads: &[Load], vaddr: u64) {
        if let Some(at) = file_offset(loads, vaddr) {
            self.take(inode, at / PAGE * PAGE, PAGE);
        }
    }

    /// Adds the unit reads of bytes `offset..offset + len` of a file.
    fn take(&mut self, inode: &Inode<'a>, offset: u64, len: u64) {
        let len = len.min(MAX_TAKEN - self.taken);
        let Ok(pieces) = self.device_ranges(inode, offset, len) else {
            return;
        };
        for piece in pieces {
            let DeviceRange::Data { blob, at, len } = piece else {
                continue;
            };
            self.taken += len;
            self.reads.extend(unit_reads(&*self.units, blob, at, len));
        }
    }

    /// Bytes `offset..offset + len` of a file (fewer at its end), read back
    /// from their units, each checked against its digest.
    fn read(&mut self, inode: &Inode<'a>, offset: u64, len: u64) -> io::Result<Vec<u8>> {
        if self.failed.is_some() {
            // Refused at the end anyway: no more fetches from a source
            // that failed (each would wait out its deadline).
            return Err(io::Error::other("an earlier read failed"));
        }
        let mut out = Vec::new();
        for piece in self.device_ranges(inode, offset, len)? {
            let (blob, at, len) = match piece {
                DeviceRange::Hole(len) => {
                    out.resize(out.len() + len as usize, 0);
                    continue;
                }
                DeviceRange::Data { blob, at, len } => (blob, at, len),
            };
            let reads = unit_reads(&*self.units, blob, at, len);
            if reads.iter().map(|r| r.len).sum::<u64>() != len {
                return Err(io::Error::other("a file's bytes outside the stored units"));
            }
            for read in reads {
                let data = match self.units.unit(read.blob, read.chunk) {
                    Ok(data) => data,
                    Err(e) => {
                        let why = e.to_string();
                        self.failed.get_or_insert(e);
                        return Err(io::Error::other(why));
                    }
                };
                let bytes = data
                    .get(read.offset as usize..(read.offset + read.len) as usize)
                    .ok_or_else(|| io::Error::other("a unit shorter than its entry"))?;
                out.extend_from_slice(bytes);
            }
        }
        Ok(out)
    }

    /// Where bytes `offset..offset + len` of a file are (fewer at its end),
    /// in file order.
    fn device_ranges(
        &self,
        inode: &Inode<'a>,
        offset: u64,
        len: u64,
    ) -> io::Result<Vec<DeviceRange>> {
        let chunks = self.erofs.chunks(inode).map_err(io::Error::other)?;
        let end = offset.saturating_add(len).min(inode.size);
        let chunk_size = 1u64 << chunks.chunk_bits;
        let mut out = Vec::new();
        let mut at = offset;
        while at < end {
            let i = at >> chunks.chunk_bits;
            let upto = (i + 1).saturating_mul(chunk_size).min(end);
            out.push(match chunks.get(i as usize) {
                Some(Chunk::Data {
                    device,
                    offset: addr,
                }) => DeviceRange::Data {
                    blob: usize::from(device) - 1,
                    at: addr + (at - i * chunk_size),
                    len: upto - at,
                },
                _ => DeviceRange::Hole(upto - at),
            });
            at = upto;
        }
        Ok(out)
    }
}

/// A piece of a file's bytes: on a device (blob `blob`, from byte `at`) or
/// a hole.
enum DeviceRange {
    Data { blob: usize, at: u64, len: u64 },
    Hole(u64),
}

/// Bytes `at..at + len` of blob `blob`'s device as reads of its units; a
/// byte in no unit ends them.
fn unit_reads(units: &dyn Units, blob: usize, at: u64, len: u64) -> Vec<ChunkRead> {
    let mut out = Vec::new();
    let (mut at, end) = (at, at.saturating_add(len));
    while at < end {
        let Some((unit, within, left)) = units.unit_at(blob, at) else {
            break;
        };
        let n = left.min(end - at);
        if n == 0 {
            break;
        }
        out.push(ChunkRead {
            blob,
            chunk: unit,
            offset: within,
            len: n,
        });
        at += n;
    }
    out
}

/// What the walk needs from an ELF file beyond the pages it takes.
#[derive(Debug, Default)]
struct ElfFacts {
    interpreter: Option<Vec<u8>>,
    needed: Vec<Vec<u8>>,
    rpath: Vec<Vec<u8>>,
    runpath: Vec<Vec<u8>>,
}

/// A `PT_LOAD` segment.
#[derive(Debug, Clone, Copy)]
struct Load {
    offset: u64,
    vaddr: u64,
    filesz: u64,
    flags: u32,
}

/// The file offset of virtual address `vaddr`, when a segment maps it from
/// the file.
fn file_offset(loads: &[Load], vaddr: u64) -> Option<u64> {
    loads
        .iter()
        .find(|l| vaddr >= l.vaddr && vaddr - l.vaddr < l.filesz)
        .map(|l| l.offset + (vaddr - l.vaddr))
}

/// The non-empty components of a path, `.` dropped.
fn components(path: &[u8]) -> impl DoubleEndedIterator<Item = Vec<u8>> + '_ {
    path.split(|&b| b == b'/')
        .filter(|c| !c.is_empty() && *c != b".")
        .map(<[u8]>::to_vec)
}

fn join(components: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for c in components {
        out.push(b'/');
        out.extend_from_slice(c);
    }
    if out.is_empty() {
        out.push(b'/');
    }
    out
}

fn parent(path: &[u8]) -> Vec<u8> {
    match path.iter().rposition(|&b| b == b'/') {
        Some(0) | None => b"/".to_vec(),
        Some(i) => path[..i].to_vec(),
    }
}

/// A search path's entries (`:`-separated, empty ones dropped).
fn split_paths(value: Vec<u8>) -> Vec<Vec<u8>> {
    value
        .split(|&b| b == b':')
        .filter(|p| !p.is_empty())
        .map(<[u8]>::to_vec)
        .collect()
}

/// `$ORIGIN` (or `${ORIGIN}`) replaced by the object's directory.
fn origin(path: &[u8], dir: &[u8]) -> Vec<u8> {
    let text = String::from_utf8_lossy(path);
    let dir = String::from_utf8_lossy(dir);
    text.replace("${ORIGIN}", &dir)
        .replace("$ORIGIN", &dir)
        .into_bytes()
}

/// `ld.so.conf` lines: comments and blanks dropped.
fn conf_lines(text: &[u8]) -> impl Iterator<Item = Vec<u8>> + '_ {
    text.split(|&b| b == b'\n').filter_map(|line| {
        let line = line
            .split(|&b| b == b'#')
            .next()
            .unwrap_or_default()
            .trim_ascii();
        (!line.is_empty()).then(|| line.to_vec())
    })
}

/// `(X, Y)` when the file is named `pythonX.Y`.
fn python_version(path: &[u8]) -> Option<(u32, u32)> {
    let name = path.rsplit(|&b| b == b'/').next()?;
    let version = std::str::from_utf8(name.strip_prefix(b"python")?).ok()?;
    let (major, minor) = version.split_once('.')?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::build::{BuildOptions, ImageBuilder};
    use std::collections::{BTreeSet, HashMap};

    const LOADER: &str = "/lib64/ld-linux-x86-64.so.2";
    const LIBC: &str = "/usr/lib/x86_64-linux-gnu/libc.so.6";

    /// A file or a symlink of a test layer.
    enum Item<'a> {
        File(&'a str, Vec<u8>),
        Link(&'a str, &'a str),
    }

    fn layer(items: &[Item]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for item in items {
            let mut h = tar::Header::new_gnu();
            h.set_mode(0o755);
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(1);
            match item {
                Item::File(path, data) => {
                    h.set_size(data.len() as u64);
                    b.append_data(&mut h, path.trim_start_matches('/'), &data[..])
                        .unwrap();
                }
                Item::Link(path, target) => {
                    h.set_entry_type(tar::EntryType::Symlink);
                    h.set_size(0);
                    b.append_link(&mut h, path.trim_start_matches('/'), target)
                        .unwrap();
                }
            }
        }
        b.into_inner().unwrap()
    }

    /// The host's copy of a file the test images hold (a Debian x86-64
    /// host, as the project's machines are).
    fn host(path: &str) -> Vec<u8> {
        std::fs::read(path).unwrap_or_else(|e| panic!("the host's {path}: {e}"))
    }

    /// A system with a dynamic loader, libc found through ld.so.conf, a
    /// program and an unrelated library, plus `more`.
    fn system(more: Vec<Item<'static>>) -> Vec<Item<'static>> {
        let mut items = vec![
            Item::File(LOADER, host("/lib64/ld-linux-x86-64.so.2")),
            Item::File(LIBC, host("/lib/x86_64-linux-gnu/libc.so.6")),
            Item::File("/usr/bin/prog", host("/usr/bin/true")),
            Item::Link("/bin", "usr/bin"),
            Item::File(
                "/etc/ld.so.conf",
                b"include /etc/ld.so.conf.d/*.conf\n".to_vec(),
            ),
            Item::File(
                "/etc/ld.so.conf.d/arch.conf",
                b"# multiarch\n/usr/lib/x86_64-linux-gnu\n".to_vec(),
            ),
            Item::File("/etc/ld.so.cache", vec![7; 5000]),
            Item::File(
                "/usr/lib/other.so",
                host("/lib/x86_64-linux-gnu/libc.so.6")[..9000].to_vec(),
            ),
        ];
        items.extend(more);
        items
    }

    /// The pages of each file `execs` take, by path.
    fn taken(items: &[Item], execs: &[&str], env: &ExecEnv) -> HashMap<String, BTreeSet<u64>> {
        let dir = tempfile::tempdir().unwrap();
        let image = built(items, dir.path());
        // Chunk digests of each file, to name what a read is of.
        let mut owner: HashMap<[u8; 32], Vec<(&str, u64)>> = HashMap::new();
        for item in items {
            if let Item::File(path, data) = item {
                for (i, c) in data.chunks(1 << 18).enumerate() {
                    owner
                        .entry(lamina_oci::sha256(c))
                        .or_default()
                        .push((path, i as u64));
                }
            }
        }
        let execs: Vec<String> = execs.iter().map(|s| s.to_string()).collect();
        let mut pages: HashMap<String, BTreeSet<u64>> = HashMap::new();
        for read in static_reads(&image, &execs, env).unwrap() {
            let digest = image.blobs[read.blob].chunks[read.chunk].digest;
            for &(path, i) in &owner[&digest] {
                let start = (i << 18) + read.offset;
                let set = pages.entry(path.to_string()).or_default();
                set.extend(start / PAGE..(start + read.len).div_ceil(PAGE));
            }
        }
        pages
    }

    /// An image of `items`, its blobs in `dir`.
    fn built(items: &[Item], dir: &std::path::Path) -> BuiltImage {
        let opts = BuildOptions {
            chunk_bits: 18,
            zstd_level: 1,
            pack_limit: 0,
            paged: true,
        };
        let mut b = ImageBuilder::new(&opts, dir).unwrap();
        b.add_layer(&layer(items)[..]).unwrap();
        b.finish(&[]).unwrap()
    }

    fn all_pages(data: &[u8]) -> BTreeSet<u64> {
        (0..(data.len() as u64).div_ceil(PAGE)).collect()
    }

    /// The pages of an ELF file's writable segments.
    fn writable_pages(data: &[u8]) -> BTreeSet<u64> {
        let header = elf::FileHeader64::<object::Endianness>::parse(data).unwrap();
        let endian = header.endian().unwrap();
        let mut pages = BTreeSet::new();
        for p in header.program_headers(endian, data).unwrap() {
            if p.p_type(endian) == elf::PT_LOAD && p.p_flags(endian) & elf::PF_W != 0 {
                let (offset, size) = (p.p_offset(endian), p.p_filesz(endian));
                pages.extend(offset / PAGE..(offset + size).div_ceil(PAGE));
            }
        }
        assert!(!pages.is_empty());
        pages
    }

    #[test]
    fn a_program_brings_its_loader_and_its_libraries_tables() {
        let env = ExecEnv {
            path: Some("/sbin:/bin".into()),
            ..ExecEnv::default()
        };
        let pages = taken(&system(Vec::new()), &["prog"], &env);
        assert_eq!(pages[LOADER], all_pages(&host(LOADER)), "all of the loader");
        assert_eq!(pages["/etc/ld.so.cache"], all_pages(&[0; 5000]));
        assert!(pages["/usr/bin/prog"].contains(&0), "the program's headers");
        let libc = host("/lib/x86_64-linux-gnu/libc.so.6");
        let libc_pages = &pages[LIBC];
        assert!(libc_pages.contains(&0), "libc, found through ld.so.conf");
        assert!(libc_pages.is_superset(&writable_pages(&libc)));
        // Its code is left to misses: libc's pages taken are a fraction.
        assert!(
            (libc_pages.len() as u64) < all_pages(&libc).len() as u64 / 4,
            "{} of libc's {} pages",
            libc_pages.len(),
            all_pages(&libc).len()
        );
        assert!(!pages.contains_key("/usr/lib/other.so"));
    }

    #[test]
    fn a_script_brings_its_interpreter_through_env() {
        let items = system(vec![
            Item::File("/app/run", b"#!/usr/bin/env prog\nexit 0\n".to_vec()),
            Item::File("/usr/bin/env", vec![0; 100]),
        ]);
        let env = ExecEnv {
            working_dir: Some("/app".into()),
            ..ExecEnv::default()
        };
        let pages = taken(&items, &["./run"], &env);
        assert_eq!(pages["/app/run"], BTreeSet::from([0]));
        assert!(pages["/usr/bin/prog"].contains(&0));
        assert!(pages.contains_key(LIBC));
    }

    #[test]
    fn a_python_interpreter_brings_its_start_up_modules() {
        let pyc = |n: u8| vec![n; 3000];
        let init = "/usr/lib/python3.11/encodings/__pycache__/__init__.cpython-311.pyc";
        let utf8 = "/usr/lib/python3.11/encodings/__pycache__/utf_8.cpython-311.pyc";
        let items = system(vec![
            Item::File("/usr/bin/python3.11", host("/usr/bin/true")),
            Item::Link("/usr/bin/python3", "python3.11"),
            Item::File(init, pyc(1)),
            Item::File(utf8, pyc(2)),
            Item::File(
                "/usr/lib/python3.11/__pycache__/json.cpython-311.pyc",
                pyc(3),
            ),
            Item::File("/usr/lib/locale/C.utf8/LC_CTYPE", vec![4; 20000]),
        ]);
        let pages = taken(&items, &["python3"], &ExecEnv::default());
        assert!(pages.contains_key("/usr/bin/python3.11"));
        assert_eq!(pages[init], BTreeSet::from([0]));
        assert_eq!(pages[utf8], BTreeSet::from([0]));
        assert_eq!(
            pages["/usr/lib/locale/C.utf8/LC_CTYPE"],
            BTreeSet::from([0])
        );
        assert!(!pages.contains_key("/usr/lib/python3.11/__pycache__/json.cpython-311.pyc"));
    }

    #[test]
    fn loops_garbage_and_missing_programs() {
        let mut junk = b"\x7fELF\x02\x01\x01".to_vec();
        junk.resize(5000, 0xff);
        let items = system(vec![
            Item::Link("/usr/bin/loop", "loop2"),
            Item::Link("/usr/bin/loop2", "/usr/bin/loop"),
            Item::Link("/usr/bin/up", "../../../../../../usr/bin/prog"),
            Item::File("/usr/bin/junk", junk),
        ]);
        let env = ExecEnv::default();
        // Not ELF after its magic: nothing but what it is.
        assert!(taken(&items, &["junk"], &env).is_empty());
        // A program that does not resolve is named in an error.
        let dir = tempfile::tempdir().unwrap();
        let image = built(&items, dir.path());
        for missing in ["loop", "missing", "./missing"] {
            let err = static_reads(&image, &[missing.to_string()], &env).unwrap_err();
            assert!(err.to_string().contains(missing), "{err}");
        }
        // `..` stops at the root, as the kernel's lookup does in a container.
        let pages = taken(&items, &["/usr/bin/up"], &env);
        assert!(pages["/usr/bin/prog"].contains(&0));
    }

    /// An ELF header whose one writable segment claims 1 TiB.
    fn boastful_elf(len: usize) -> Vec<u8> {
        let mut f = b"\x7fELF\x02\x01\x01".to_vec();
        f.resize(16, 0);
        for (v, n) in [(2u64, 2), (62, 2), (1, 4), (0, 8), (64, 8), (0, 8), (0, 4)] {
            f.extend_from_slice(&v.to_le_bytes()[..n]);
        }
        for v in [64u16, 56, 1, 64, 0, 0] {
            f.extend_from_slice(&v.to_le_bytes());
        }
        f.extend_from_slice(&elf::PT_LOAD.to_le_bytes());
        f.extend_from_slice(&(elf::PF_R | elf::PF_W).to_le_bytes());
        for v in [0u64, 0, 0, 1 << 40, 1 << 40, 4096] {
            f.extend_from_slice(&v.to_le_bytes());
        }
        f.resize(len, 0);
        f
    }

    #[test]
    fn what_a_header_claims_is_bounded_by_the_file() {
        let items = vec![Item::File("/usr/bin/boast", boastful_elf(10_000))];
        let pages = taken(&items, &["/usr/bin/boast"], &ExecEnv::default());
        assert_eq!(pages["/usr/bin/boast"], BTreeSet::from([0, 1, 2]));
    }

    #[test]
    fn the_command_comes_from_the_config() {
        let config = serde_json::json!({"config": {
            "Entrypoint": ["/usr/bin/env", "-i", "A=b", "python3"],
            "Cmd": ["-c", "pass"],
            "Env": ["PATH=/opt/bin:/usr/bin", "LD_LIBRARY_PATH=/opt/lib"],
            "WorkingDir": "/srv"
        }});
        let argv = config_command(&config);
        assert_eq!(argv, ["/usr/bin/env", "-i", "A=b", "python3", "-c", "pass"]);
        assert_eq!(command_executables(&argv), ["/usr/bin/env", "python3"]);
        let env = ExecEnv::from_config(&config);
        assert_eq!(env.path.as_deref(), Some("/opt/bin:/usr/bin"));
        assert_eq!(env.library_path.as_deref(), Some("/opt/lib"));
        assert_eq!(env.working_dir.as_deref(), Some("/srv"));
        assert!(config_command(&serde_json::json!({"config": {}})).is_empty());
    }

    /// `items` as an image of one gzip layer, its tar beside it.
    fn gzip_image(items: &[Item]) -> (Vec<u8>, crate::tar_index::tests::Layers) {
        let tar = layer(items);
        let blob = crate::tar_index::tests::gzip(&tar);
        let media_type = lamina_oci::media_types::OCI_LAYER_GZIP;
        let src = crate::tar_index::tests::image(vec![(tar.clone(), blob, media_type)]);
        (tar, src)
    }

    /// `lamina index --boot-exec`: the walk over an indexed image (files
    /// in the layer's tar, read as gzip spans with their windows) takes
    /// the pages it takes of the converted image.
    #[test]
    fn an_indexed_image_gives_the_converted_images_set() {
        let items = system(Vec::new());
        let env = ExecEnv {
            path: Some("/bin".into()),
            ..ExecEnv::default()
        };
        let (tar, src) = gzip_image(&items);
        let built = crate::tar_index::build(&src, 64 << 10, &|_| {}).unwrap();
        assert!(built.index.layers[0].windows.iter().any(Option::is_some));
        let mut units = crate::tar_index::SpanUnits::new(&src, &built);
        let execs = ["prog".to_string()];
        let reads = static_unit_reads(&built.metadata, &mut units, &execs, &env).unwrap();
        // Where each file's bytes are in the tar.
        let mut files = Vec::new();
        for entry in tar::Archive::new(&tar[..]).entries().unwrap() {
            let entry = entry.unwrap();
            let path = format!("/{}", entry.path().unwrap().display());
            files.push((path, entry.raw_file_position(), entry.size()));
        }
        let mut pages: HashMap<String, BTreeSet<u64>> = HashMap::new();
        for read in reads {
            let span = &built.index.layers[read.blob].blob.chunks[read.chunk];
            let start = span.cache_offset.get() + read.offset;
            let end = start + read.len;
            for (path, at, size) in &files {
                if start < at + size && end > *at {
                    let (from, to) = (start.max(*at) - at, end.min(at + size) - at);
                    let set = pages.entry(path.clone()).or_default();
                    set.extend(from / PAGE..to.div_ceil(PAGE));
                }
            }
        }
        assert!(pages.contains_key(LIBC) && pages.contains_key(LOADER));
        assert_eq!(pages, taken(&items, &["prog"], &env));
    }

    /// A source that reads layers whole only (docker-archive) cannot give
    /// an indexed image's files: an error, not an index without the boot
    /// set asked for.
    #[test]
    fn an_index_source_without_ranges_is_an_error() {
        let (_, mut src) = gzip_image(&system(Vec::new()));
        src.ranges = false;
        let built = crate::tar_index::build(&src, 64 << 10, &|_| {}).unwrap();
        let mut units = crate::tar_index::SpanUnits::new(&src, &built);
        let env = ExecEnv::default();
        let execs = ["/usr/bin/prog".to_string()];
        let err = static_unit_reads(&built.metadata, &mut units, &execs, &env).unwrap_err();
        assert!(matches!(err, StaticBootError::Read(_)), "{err}");
        assert!(err.to_string().contains("whole only"), "{err}");
    }
}
