//! Newline-framed input from peers the launcher does not trust (the guest's heartbeat port, the
//! control socket), read with a length cap: a line longer than the cap is skipped and reported,
//! so a peer that sends an endless line costs at most the cap in memory, never more.

use tokio::io::{AsyncBufRead, AsyncBufReadExt};

/// One framed unit of input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// A line within the cap, without its newline.
    Line(Vec<u8>),
    /// A line longer than the cap, dropped; how many bytes it had (newline excluded).
    TooLong(u64),
}

/// Splits a byte stream into [`Frame`]s without ever buffering more than `max` bytes.
#[derive(Debug)]
pub struct LineFramer {
    max: usize,
    line: Vec<u8>,
    /// Length so far of a line that went over the cap (its bytes are not kept).
    skipped: Option<u64>,
}

impl LineFramer {
    /// A framer for lines of at most `max` bytes.
    pub fn new(max: usize) -> Self {
        Self {
            max,
            line: Vec::new(),
            skipped: None,
        }
    }

    /// The cap.
    pub fn max(&self) -> usize {
        self.max
    }

    /// Bytes held for the line in progress (never more than the cap).
    pub fn buffered(&self) -> usize {
        self.line.capacity()
    }

    /// Takes bytes from the front of `input`, up to and including the first newline. Returns
    /// how many bytes it took and the frame the newline completed, if it saw one.
    pub fn feed(&mut self, input: &[u8]) -> (usize, Option<Frame>) {
        let (data, taken, complete) = match input.iter().position(|b| *b == b'\n') {
            Some(i) => (&input[..i], i + 1, true),
            None => (input, input.len(), false),
        };
        match &mut self.skipped {
            Some(n) => *n += data.len() as u64,
            None if self.line.len() + data.len() > self.max => {
                self.skipped = Some((self.line.len() + data.len()) as u64);
                self.line = Vec::new();
            }
            None => {
                // Exact growth: the buffer never holds more than the cap.
                self.line.reserve_exact(data.len());
                self.line.extend_from_slice(data);
            }
        }
        let frame = complete.then(|| self.take());
        (taken, frame)
    }

    /// At the end of the stream: the last line if it had no newline.
    pub fn finish(&mut self) -> Option<Frame> {
        (self.skipped.is_some() || !self.line.is_empty()).then(|| self.take())
    }

    fn take(&mut self) -> Frame {
        match self.skipped.take() {
            Some(n) => Frame::TooLong(n),
            None => Frame::Line(std::mem::take(&mut self.line)),
        }
    }
}

/// Reads [`Frame`]s from a buffered stream.
#[derive(Debug)]
pub struct LineReader<R> {
    inner: R,
    framer: LineFramer,
}

impl<R: AsyncBufRead + Unpin> LineReader<R> {
    /// Reads lines of at most `max` bytes from `inner`.
    pub fn new(inner: R, max: usize) -> Self {
        Self {
            inner,
            framer: LineFramer::new(max),
        }
    }

    /// The next frame; `None` at the end of the stream.
    pub async fn next_frame(&mut self) -> std::io::Result<Option<Frame>> {
        loop {
            let chunk = self.inner.fill_buf().await?;
            if chunk.is_empty() {
                return Ok(self.framer.finish());
            }
            let (taken, frame) = self.framer.feed(chunk);
            self.inner.consume(taken);
            if frame.is_some() {
                return Ok(frame);
            }
        }
    }

    /// Bytes held for the line in progress.
    pub fn buffered(&self) -> usize {
        self.framer.buffered()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncWriteExt, BufReader};

    fn frames(input: &[&[u8]], max: usize) -> Vec<Frame> {
        let mut f = LineFramer::new(max);
        let mut out = Vec::new();
        for chunk in input {
            let mut rest = *chunk;
            while !rest.is_empty() {
                let (n, frame) = f.feed(rest);
                rest = &rest[n..];
                out.extend(frame);
            }
        }
        out.extend(f.finish());
        out
    }

    #[test]
    fn splits_lines_across_chunks_and_keeps_an_unterminated_last_line() {
        assert_eq!(
            frames(&[b"ab", b"c\nde\n", b"", b"f"], 8),
            [
                Frame::Line(b"abc".to_vec()),
                Frame::Line(b"de".to_vec()),
                Frame::Line(b"f".to_vec())
            ]
        );
        assert_eq!(frames(&[b"\n"], 8), [Frame::Line(Vec::new())]);
        assert_eq!(frames(&[b""], 8), []);
    }

    #[test]
    fn an_over_long_line_is_counted_and_the_next_one_read() {
        assert_eq!(
            frames(&[b"12345", b"6789\nok\n", b"1234567890"], 8),
            [
                Frame::TooLong(9),
                Frame::Line(b"ok".to_vec()),
                Frame::TooLong(10)
            ]
        );
        // Exactly the cap is still a line.
        assert_eq!(
            frames(&[b"12345678\n"], 8),
            [Frame::Line(b"12345678".to_vec())]
        );
    }

    /// A peer that sends 32 MiB without a newline: the reader holds at most the cap, then reads
    /// the next line normally.
    #[tokio::test]
    async fn a_multi_megabyte_line_costs_at_most_the_cap() {
        let (client, server) = tokio::io::duplex(64 * 1024);
        let writer = tokio::spawn(async move {
            let mut client = client;
            let chunk = vec![b'x'; 64 * 1024];
            for _ in 0..512 {
                client.write_all(&chunk).await.unwrap();
            }
            client.write_all(b"\nnext\n").await.unwrap();
        });
        let mut r = LineReader::new(BufReader::new(server), 4096);
        assert_eq!(
            r.next_frame().await.unwrap(),
            Some(Frame::TooLong(32 << 20))
        );
        assert!(r.buffered() <= 4096, "held {} bytes", r.buffered());
        assert_eq!(
            r.next_frame().await.unwrap(),
            Some(Frame::Line(b"next".to_vec()))
        );
        assert_eq!(r.next_frame().await.unwrap(), None);
        writer.await.unwrap();
    }
}
